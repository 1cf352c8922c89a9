"""EDM2's magnitude-preserving U-Net in its shape (fixtures/models/mp_unet.py), converted: found
converting NVlabs/edm2's networks_edm2.py, where four things went wrong - the conversion
raised "expected dtype Half for `end` but got Float" (``lerp`` of an fp32 branch and a low
one), ran 83 of 88 ops in fp32 (every MPConv whole, for the fp32 weight normalisation
inside it, and ``w.to(x.dtype)`` read as the user asking for fp32), the training check's copy
raised RecursionError (a persistent class's ``__reduce__``), and the fx backend's graph raised
NameError on ``np.float64(...)``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import ampaudit
from ampaudit.convert import fp32_ops
from ampaudit.convert.verify import ZERO_REFERENCE
from ampaudit.core.catalog import builtin_catalog
from ampaudit.graph.fx_tracer import LOC
from ampaudit.graph.model_copy import copy_model
from ampaudit.graph.recorder import DYNAMIC, record_trace
from fixtures.models import mp_unet


def _convert(backend: str = "modules", zero_gain: bool = False):
    return ampaudit.convert(mp_unet.get_model(zero_gain=zero_gain), mp_unet.example_inputs(), train_steps=0,
                            backend=backend)


def test_the_weight_normalising_conv_runs_low_and_its_norm_in_fp32():
    converted = _convert()
    plan = {(r["module"], r["kind"]): r["compute"] for r in converted.plan if r["kind"] in ("conv2d", "vector_norm")}
    assert plan[("unet.blocks.0.conv0", "conv2d")] == "float16"  # was float32: the MPConv ran whole in fp32
    assert plan[("unet.blocks.0.conv0", "vector_norm")] == "float32"
    seen = {}
    converted.unet.blocks[0].conv0.register_forward_hook(lambda m, a, out: seen.update(dtype=out.dtype))
    with torch.no_grad():
        out = converted(*mp_unet.example_inputs())
    assert seen["dtype"] == torch.float16  # what runs is what the plan says
    with torch.no_grad():
        want = mp_unet.get_model(zero_gain=False)(*mp_unet.example_inputs())
    assert 0 < float((out.float() - want).norm() / want.norm()) <= 1e-2
    assert 0 < converted.summary.error_before <= 1e-2


def test_lerp_of_an_fp32_branch_and_a_low_one_gets_one_dtype(monkeypatch):
    _convert()  # runs: the branches meet in mp_sum's lerp, cast to the wider
    real = fp32_ops.Fp32Ops.__init__

    def without_promotion(self, records, catalog, ran=()):
        real(self, records, catalog, ())

    monkeypatch.setattr(fp32_ops.Fp32Ops, "__init__", without_promotion)
    with pytest.raises(RuntimeError, match="expected dtype"):
        _convert()


def test_a_cast_to_another_tensors_dtype_follows_it_after_the_model_made_its_input_fp32():
    net = mp_unet.get_model().eval()
    gm, _ = record_trace(net, mp_unet.example_inputs(), {}, builtin_catalog())
    casts = {}
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target == "to" and torch.float32 in node.args:
            loc = node.meta[LOC]
            casts.setdefault(loc.line, set()).add(bool(node.meta.get(DYNAMIC)))
    source = Path(mp_unet.__file__).read_text().splitlines()
    by_text = {source[line - 1].strip(): marks for line, marks in casts.items()}
    assert by_text["w = w.to(x.dtype)"] == {True}  # read from x, which Precond made fp32 itself
    assert by_text["w = self.weight.to(torch.float32)"] == {False}  # written out: the user's fp32
    assert by_text["x = x.to(torch.float32)  # as EDM2: every x.dtype after this reads float32 in a recording"] \
        == {False}


def test_a_zero_output_gain_leaves_the_output_exactly_fp32s_and_says_so():
    converted = _convert(zero_gain=True)
    assert converted.summary.error_before is None and ZERO_REFERENCE in converted.summary.notes


def test_a_class_reduced_with_its_state_as_argument_is_copied_once_converted():
    converted = _convert()
    twin = copy_model(converted)
    assert twin.forward.__self__ is twin and converted.forward.__self__ is converted
    with torch.no_grad():
        assert torch.equal(twin(*mp_unet.example_inputs()), converted(*mp_unet.example_inputs()))


def test_the_users_deepcopy_of_the_converted_model_is_a_converted_model_of_its_own():
    """EDM2's loop keeps its EMA as ``copy.deepcopy(net)``: of a converted persistent-class
    model that recursed (the instance-bound forward led back to the module); with the model
    and its parameters in one deepcopy (a checkpoint dict), they stay one another's."""
    converted = _convert()
    twin = copy.deepcopy(converted)
    assert twin.forward.__self__ is twin and converted.forward.__self__ is converted
    blocks = [(m, c) for m, c in zip(twin.modules(), converted.modules(), strict=True) if "forward" in vars(c)]
    assert blocks and all(m.forward.__self__ is m and m.__deepcopy__.__self__ is m for m, _ in blocks)
    with torch.no_grad():
        assert torch.equal(twin(*mp_unet.example_inputs()), converted(*mp_unet.example_inputs()))
        next(twin.parameters()).add_(1.0)  # the copy's weights are its own
        assert not torch.equal(twin(*mp_unet.example_inputs()), converted(*mp_unet.example_inputs()))
    state = copy.deepcopy({"net": converted, "params": list(converted.parameters())})
    assert all(a is b for a, b in zip(state["params"], state["net"].parameters(), strict=True))


def test_a_converted_model_pickles_whole_and_loads_as_a_converted_model(tmp_path):
    """``torch.save(model)`` and EDM2's network snapshots (a pickle of its EMA): a forward bound
    to its module pickled as ``getattr(module, "forward")``, which the load ran before the module
    had its attributes (AttributeError for an nn.Module, RecursionError in a persistent class's
    state), and the fp32 ops' cache held TensorBase.pow (PicklingError)."""
    converted = _convert()
    torch.save({"ema": converted}, tmp_path / "snapshot.pt")
    loaded = torch.load(tmp_path / "snapshot.pt", weights_only=False)["ema"]
    bound = [m for m in loaded.modules() if "forward" in vars(m)]
    assert bound and all(m.forward.__self__ is m and m.__deepcopy__.__self__ is m for m in bound)
    with torch.no_grad():
        assert torch.equal(loaded(*mp_unet.example_inputs()), converted(*mp_unet.example_inputs()))
    twin = copy.deepcopy(loaded)  # the loaded model is a converted one: its copy and its pickle work
    assert twin.forward.__self__ is twin
    torch.save(twin, tmp_path / "again.pt")
    assert torch.load(tmp_path / "again.pt", weights_only=False).forward.__func__ is converted.forward.__func__
    shallow = copy.copy(converted)  # asks the same __reduce_ex__, and takes five fields at most
    assert shallow.forward.__self__ is shallow


@pytest.mark.parametrize("whole", [True, False], ids=["traced whole", "traced in parts"])
def test_the_fx_backend_s_converted_model_pickles_whole(tmp_path, whole):
    """A GraphModule's pickle traces its code again on load with the class that traced it:
    the audit tracer, which takes a catalog (TypeError on load); a plain tracer traced through
    the casts and fed fp32 to fp16 weights."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    model, inputs = (net, (torch.randn(3, 4),)) if whole else \
        (mp_unet.get_model(zero_gain=False), mp_unet.example_inputs())
    converted = ampaudit.convert(model, inputs, train_steps=0, backend="fx")
    assert any(isinstance(m, torch.fx.GraphModule) for m in converted.modules())
    torch.save(converted, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(*inputs), converted(*inputs))


def test_the_fx_backend_runs_a_graph_holding_numpy_scalars():
    converted = _convert(backend="fx")  # np.sqrt(...) constants: NameError 'np' when the graph ran
    assert "np." not in converted.code
    assert 0 < converted.summary.error_before <= 1e-2
