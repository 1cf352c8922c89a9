"""Tracing: user file:line and module path on every node; the recorder and partial fallbacks."""

from __future__ import annotations

import torch
from torch import nn

from ampaudit.core.catalog import builtin_catalog
from ampaudit.graph.forward import ExampleInputs
from ampaudit.graph.fx_tracer import LOC, MODULE, fx_trace
from ampaudit.graph.recorder import record_trace
from ampaudit.graph.trace import trace_model
from ampaudit.load.loader import load_target
from tests.conftest import ROOT, line_of, model


def _ops(gm):
    return [(n.op, str(n.target), n.meta[LOC][1], n.meta[MODULE]) for n in gm.graph.nodes
            if n.op.startswith("call_")]


def test_fx_stamps_user_lines_and_module_paths():
    loaded = load_target(model("clean_transformer.py"))
    gm, failure = fx_trace(loaded.model, builtin_catalog())
    assert failure is None
    files = {n.meta[LOC][0] for n in gm.graph.nodes}
    assert files == {str(ROOT / "fixtures/models/clean_transformer.py")}
    by_target = {}
    for _op, target, line, module in _ops(gm):
        by_target.setdefault(target, []).append((line, module))
    assert by_target["blocks.0.ln1"] == [(43, "blocks.0.ln1")]
    assert by_target["blocks.1.ln2"] == [(50, "blocks.1.ln2")]
    assert by_target["ln_f"] == [(77, "ln_f")]
    sdpa = [v for k, v in by_target.items() if "scaled_dot_product_attention" in k]
    assert sdpa == [[(47, "blocks.0"), (47, "blocks.1")]]
    ce = [v for k, v in by_target.items() if "cross_entropy" in k]
    assert ce == [[(79, None)]]


def test_recorder_sees_every_executed_op_with_its_line():
    loaded = load_target(model("untraceable.py"))
    gm, out = record_trace(loaded.model, loaded.inputs.args, {}, builtin_catalog())
    path = model("untraceable.py")
    branch = line_of(path, "if x.abs().sum() > 0:")
    ops = [(op, target.split(" of ")[0], line, module) for op, target, line, module in _ops(gm)]
    assert ops == [
        ("call_module", "fc1", 21, "fc1"),
        ("call_module", "norm", 21, "norm"),
        ("call_method", "abs", branch, None),
        ("call_method", "sum", branch, None),
        ("call_method", "gt", branch, None),
        ("call_function", "<built-in method relu", branch + 1, None),
        ("call_module", "fc2", branch + 1, "fc2"),
        ("call_function", "<built-in method softmax", 27, None),
    ]
    # The recorded graph is a faithful straight-line program for these inputs: replayed in
    # fp32 it gives the model's own fp32 output bit for bit (the recording itself ran in float64).
    with torch.no_grad():
        expected = loaded.model(*loaded.inputs.args)
    torch.testing.assert_close(gm(*loaded.inputs.args), expected, rtol=0, atol=0)
    torch.testing.assert_close(out, expected)


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x, *, shift=None):
        y = self.fc(x) * self.scale
        if y.sum() > -1e9:  # data-dependent
            y = 1 - y
            y[0] = 0.0
        parts = y.split(2, dim=-1)
        return {"out": torch.cat([parts[1], parts[0]], -1) + shift, "t": y.T}


def test_recorder_handles_kwargs_buffers_reflected_ops_setitem_and_dict_outputs():
    m = _Branchy().eval()
    x, shift = torch.randn(3, 4), torch.randn(4)
    gm, out = record_trace(m, (x,), {"shift": shift}, builtin_catalog())
    replay = gm(x, shift=shift)
    expected = m(x, shift=shift)
    assert replay.keys() == out.keys() == expected.keys()
    for key in out:
        torch.testing.assert_close(replay[key], expected[key], rtol=0, atol=0)
        assert replay[key].dtype == torch.float32
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith("_ampaudit_constant")]


def test_trace_model_prefers_fx_then_recorder_then_partial():
    catalog = builtin_catalog()
    clean = load_target(model("clean_cnn.py"))
    assert trace_model(clean.model, catalog, clean.inputs).method == "fx"

    gated = load_target(model("untraceable.py"))
    result = trace_model(gated.model, catalog, gated.inputs)
    assert result.method == "recorder"
    assert [(f.module, f.loc[1]) for f in result.failures] == [("", 23)]

    partial = load_target(model("untraceable_no_inputs.py"))
    result = trace_model(partial.model, catalog, None)
    assert result.method == "fx-partial"
    assert [(f.module, f.type_name, f.loc[1]) for f in result.failures] == [("router", "Router", 21)]
    assert result.opaque == ["router"]
    seen = sorted((sub.prefix, str(n.target)) for sub in result.graphs for n in sub.gm.graph.nodes
                  if n.op == "call_module")
    # The root graph keeps the router whole; the router's own children are still listed.
    assert seen == [("", "embed"), ("", "head"), ("", "norm"), ("", "router"),
                    ("router", "left"), ("router", "right")]


def test_partial_when_the_root_itself_is_untraceable():
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            self.b = nn.LayerNorm(2)

        def forward(self, x):
            return self.a(x) if x.max() > 0 else self.b(x)

    result = trace_model(Root(), builtin_catalog(), None)
    assert result.method == "fx-partial"
    assert [f.module for f in result.failures] == [""]
    prefixes = sorted((s.prefix, str(n.target)) for s in result.graphs for n in s.gm.graph.nodes
                      if n.op == "call_module")
    assert prefixes == [("", "b"), ("a", "0"), ("a", "1")]


def test_recorder_runs_only_with_inputs():
    gated = load_target(model("untraceable.py"))
    result = trace_model(gated.model, builtin_catalog(), ExampleInputs(gated.inputs.args, {}, "t"))
    assert result.output is not None


class _Dtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > -1e9:  # untraceable: the recorder runs
            up = h.to(torch.float32)  # written out: an upcast
            back = up.softmax(-1).to(h.dtype)  # follows h
            masked = h.masked_fill(h > 0, torch.finfo(h.dtype).min)  # follows h
            fixed = h.masked_fill(h > 0, torch.finfo(torch.float32).min)  # written out
            return back, masked, fixed


def test_recorder_tells_written_dtypes_from_ones_that_follow_a_tensor():
    from ampaudit.graph.recorder import DYNAMIC

    m = _Dtypes()
    weight = m.fc.weight
    gm, out = record_trace(m, (torch.randn(2, 4),), {}, builtin_catalog())
    casts = [(n.kwargs.get("dtype", n.args[1] if len(n.args) > 1 else None), bool(n.meta.get(DYNAMIC)))
             for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"]
    assert casts == [(torch.float32, False), (torch.float32, True)]
    fills = [(n.args[2], bool(n.meta.get(DYNAMIC))) for n in gm.graph.nodes if n.target == "masked_fill"]
    fp32_min = torch.finfo(torch.float32).min
    assert fills == [(fp32_min, True), (fp32_min, False)]
    # The model is left exactly as it was: same parameter objects, fp32 again.
    assert m.fc.weight is weight and weight.dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in out)
