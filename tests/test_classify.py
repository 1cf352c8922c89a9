"""Classification pinned on the clean fixtures: kind, precision, module and line of every op."""

from __future__ import annotations

import torch
from torch import fx, nn

import ampaudit
from ampaudit.check.api import check_path
from ampaudit.core.catalog import builtin_catalog
from ampaudit.graph.dtype_flow import FP32, LOW, autocast_flow
from ampaudit.graph.kinds import node_kind
from tests.conftest import line_of, model


def _ops(report):
    return [(n.kind, n.precision.value, n.module, n.line) for n in report.nodes if n.op.startswith("call_")]


def test_clean_cnn_every_op_pinned():
    report = check_path(model("clean_cnn.py"))
    conv = [("conv2d", "fp16"), ("batch_norm", "fp32"), ("relu", "neutral")]
    expected = []
    for block, pool in (("features.0", "features.1"), ("features.2", "features.3"), ("features.4", None)):
        expected += [(k, p, f"{block}.{i}", 35) for i, (k, p) in enumerate(conv)]
        if pool:
            expected.append(("max_pool2d", "neutral", pool, 35))
    expected += [("adaptive_avg_pool2d", "neutral", "pool", 36), ("flatten", "neutral", "flatten", 37),
                 ("linear", "fp16", "head", 38)]
    assert _ops(report) == expected
    assert report.findings == []
    bn = next(n for n in report.nodes if n.kind == "batch_norm")
    assert "fp32" in bn.reason or "statistic" in bn.reason


def test_clean_transformer_key_ops():
    report = check_path(model("clean_transformer.py"))
    ops = _ops(report)
    assert [o for o in ops if o[0] == "layer_norm"] == [
        ("layer_norm", "fp32", "blocks.0.ln1", 43), ("layer_norm", "fp32", "blocks.0.ln2", 50),
        ("layer_norm", "fp32", "blocks.1.ln1", 43), ("layer_norm", "fp32", "blocks.1.ln2", 50),
        ("layer_norm", "fp32", "ln_f", 77)]
    assert [o for o in ops if o[0] == "scaled_dot_product_attention"] == [
        ("scaled_dot_product_attention", "fp16", "blocks.0", 47),
        ("scaled_dot_product_attention", "fp16", "blocks.1", 47)]
    assert [o for o in ops if o[0] == "cross_entropy"] == [("cross_entropy", "fp32", None, 79)]
    assert [o for o in ops if o[0] == "embedding"] == [("embedding", "fp32", "tok_emb", 74),
                                                      ("embedding", "fp32", "pos_emb", 74)]
    assert sum(o[0] == "linear" for o in ops) == 2 * 6 + 1  # q, k, v, out, mlp x2 per block, lm head
    assert report.findings == []
    assert report.summary() == {"nodes": 93, "fp32": 8, "fp16": 15, "errors": 0, "warnings": 0, "infos": 0}


def test_recorded_ops_are_classified_too():
    report = check_path(model("untraceable.py"))
    assert report.target.trace == "recorder"
    assert _ops(report) == [
        ("linear", "fp16", "fc1", 21), ("layer_norm", "fp32", "norm", 21),
        ("abs", "neutral", None, 23), ("sum", "fp32", None, 23), ("gt", "promote", None, 23),
        ("relu", "neutral", None, 24), ("linear", "fp16", "fc2", 24), ("softmax", "fp32", None, 27)]


def test_opaque_module_is_neutral_and_its_children_are_classified():
    report = check_path(model("untraceable_no_inputs.py"))
    by_name = {n.name: n for n in report.nodes}
    assert by_name["router"].kind == "router" and by_name["router"].precision.value == "neutral"
    assert (by_name["router:left"].kind, by_name["router:left"].module, by_name["router:left"].line) == (
        "linear", "router.left", 19)


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.emb = nn.Embedding(8, 4)

    def forward(self, x, idx):
        h = self.fc(x)
        a = h.var(-1, keepdim=True)  # the AMP101 line
        b = self.ln(h) + h
        c = h.float().std()
        d = self.emb(idx) * h.half()
        return a, b, c, d, torch.softmax(h, -1)


def test_autocast_dtype_flow():
    gm = fx.symbolic_trace(_Mixed())
    catalog = builtin_catalog()
    kinds = {n: node_kind(n, gm, catalog)[0] for n in gm.graph.nodes}
    flow = {n.name: f for n, f in autocast_flow(gm, kinds, catalog).items()}
    assert flow["fc"] == LOW  # lower-precision list
    assert flow["var"] == LOW  # unlisted: follows its fp16 input - what AMP101 reports
    assert flow["ln"] == FP32 and flow["add"] == FP32  # upcast, then promotion wins
    assert flow["float_1"] == FP32 and flow["std"] == FP32
    assert flow["emb"] == FP32 and flow["half"] == LOW and flow["mul"] == FP32
    assert flow["softmax"] == FP32


def test_python_api_points_at_the_callers_model_source():
    report = ampaudit.check(_Mixed(), (torch.randn(2, 4), torch.tensor([1, 2])), dtype=torch.bfloat16)
    assert report.dtype.name == "bfloat16"
    assert report.target.file == "tests/test_classify.py" and report.target.entry == "_Mixed"
    var = [f for f in report.findings if f.rule == "AMP101"]
    assert [(f.file, f.line, f.node) for f in var] == [
        ("tests/test_classify.py", line_of("tests/test_classify.py", "# the AMP101 " + "line"), "var")]
    assert "leaves it in bfloat16" in var[0].message
    assert report.to_dict()["summary"]["infos"] == 1
