"""The promotion search's cost: forward passes counted (not timed) on models with 1 to 10
offending ops (fixtures/models/offending_ops.py), in both backends."""

from __future__ import annotations

import pytest
import torch

import ampaudit
from ampaudit.convert.verify import MAX_FORWARDS
from ampaudit.load.loader import load_target
from tests.conftest import MODELS, model


def _fixture():
    import importlib.util

    spec = importlib.util.spec_from_file_location("offending_ops", MODELS / "offending_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


offending = _fixture()

# forward passes: the fp32 reference, the first comparison, the ops over the tolerance
# promoted together, then the set without each of them (all needed here)
FORWARDS = {1: 3, 3: 6, 5: 8, 10: 13}


@pytest.mark.parametrize("backend", ["fx", "modules"])
@pytest.mark.parametrize("n", sorted(FORWARDS))
def test_search_forward_passes_on_n_offending_ops(backend, n):
    x = offending.example_inputs()
    model_mp = ampaudit.convert(offending.build(n), x, backend=backend)
    summary = model_mp.summary
    assert summary.search["forwards"] == FORWARDS[n] <= MAX_FORWARDS
    assert summary.search["tried"] == FORWARDS[n] - 2
    # exactly the offending ops are promoted: each block's linear, whose rounding the
    # subtraction (or the scaling back) exposes
    assert {p["node"] for p in summary.promoted} == {f"blocks_{i}_proj" for i in range(n)}
    assert summary.error_before > 0.1 and summary.error_after < 1e-3


@pytest.mark.parametrize("backend", ["fx", "modules"])
def test_ops_whose_error_only_an_fp32_op_shows_are_ranked_first(backend):
    # Hidden: a linear near 1000 normalised by an fp32 LayerNorm - the linear's own error is
    # small, the LayerNorm's on rounded inputs is not: its fp16 feeder is the unit to promote
    model_mp = ampaudit.convert(offending.build(3, hidden=2), offending.example_inputs(), backend=backend)
    summary = model_mp.summary
    assert summary.search["forwards"] == 8
    assert {p["node"] for p in summary.promoted} == {*(f"blocks_{i}_proj" for i in range(3)), "hidden_0_proj",
                                                     "hidden_1_proj"}


def test_module_tree_search_stops_at_the_budget():
    # fx cannot trace the top level: the search goes by modules, and stops trimming its
    # answer once it has made MAX_FORWARDS forward passes - the answer still matches fp32
    x = offending.example_inputs()
    model_mp = ampaudit.convert(offending.build(3, traceable=False), x, backend="fx")
    summary = model_mp.summary
    assert summary.search["forwards"] == MAX_FORWARDS
    assert summary.error_before > 0.1 and summary.error_after < 1e-3
    with torch.no_grad():
        assert float((model_mp(*x) - offending.build(3, traceable=False)(*x)).norm()) < 1e-2


def test_search_doubles_when_no_op_is_over_the_tolerance():
    # at 5e-5 the worst op alone fails, the worst two match; then the first of them alone is
    # tried (the last is needed: one op alone failed). (At 1e-4 fc1 alone is enough since the
    # plan's fp32 softmax runs in fp32 on a CPU too.)
    loaded = load_target(model("untraceable.py"))
    model_mp = ampaudit.convert(loaded.model, loaded.inputs, backend="modules", tolerance=5e-5)
    summary = model_mp.summary
    assert {p["node"] for p in summary.promoted} == {"fc1", "fc2"}
    assert summary.search == {"forwards": 5, "tried": 3}


@pytest.mark.parametrize("backend", ["fx", "modules"])
def test_untrained_batch_norms_are_compared_as_training_normalises(backend):
    # Freshly built, its BatchNorms do not normalise in eval mode and the logits come out near
    # 6e-7, below fp16's normal range: compared that way the error is 7% and the search would
    # promote ops (16 forward passes) for an error training never has. Compared with the
    # batch's statistics, as training and the range audit do, nothing needs promoting.
    loaded = load_target(model("untrained_batchnorm.py"))
    with torch.no_grad():
        assert float(loaded.model(*loaded.inputs.args).abs().max()) < 1e-6
    model_mp = ampaudit.convert(loaded.model, loaded.inputs, backend=backend)
    summary = model_mp.summary
    assert summary.error_before < 1e-3 and summary.promoted == []
    assert summary.search == {"forwards": 2, "tried": 0}
    for module in (*loaded.model.modules(), *model_mp.modules()):  # running statistics untouched
        if isinstance(module, torch.nn.BatchNorm2d):
            assert int(module.num_batches_tracked) == 0 and not module.running_mean.any()


@pytest.mark.parametrize("backend", ["fx", "modules"])
def test_a_batch_with_one_value_per_channel_is_compared_as_the_model_runs(backend):
    # Training refuses such a batch ("more than 1 value per channel"): verification and the
    # range audit keep the untrained BatchNorm's own output instead of the batch's statistics.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)).eval()
    x = torch.randn(1, 4)
    model_mp = ampaudit.convert(net, (x,), backend=backend)
    assert model_mp.summary.error_before < 1e-2 and model_mp.summary.promoted == []
    report = ampaudit.check(net, (x,))
    (norm,) = [n for n in report.nodes if n.kind == "batch_norm"]
    with torch.no_grad():
        want = float(net[:2](x).abs().max())
    assert norm.measured["absmax"] == pytest.approx(want, rel=1e-3)
