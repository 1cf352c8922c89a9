"""convert keeps what the model's author wrote for backward: a custom ``torch.autograd.Function``
is one call whose own forward and backward run (fixtures/models/straight_through.py: a
straight-through estimator and a ``custom_fwd(cast_inputs=float32)`` norm)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import ampaudit  # noqa: E402
from ampaudit.load.loader import load_target  # noqa: E402
from tests.conftest import line_of, model  # noqa: E402


def _qat():
    loaded = load_target(model("straight_through.py"))
    return loaded.model.train(), loaded.inputs.args[0]


def test_custom_functions_train_as_under_autocast_parameter_by_parameter():
    net, x = _qat()
    reference = copy.deepcopy(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    model_mp, opt_mp = ampaudit.convert(net, optimizer, example_inputs=(x,), train_steps=0, loss_scale=None,
                                        weights="fp32")
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    target = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        opt_mp.zero_grad()
        ref_optimizer.zero_grad()
        opt_mp.backward(nn.functional.mse_loss(model_mp(x).float(), target))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(reference(x).float(), target)
        loss.backward()
        for (name, mine), (_, theirs) in zip(model_mp.named_parameters(), reference.named_parameters(), strict=True):
            assert theirs.grad.norm() > 0.05, (step, name)
            error = float((mine.grad - theirs.grad).norm() / theirs.grad.norm())
            assert error < 0.05, (step, name, error)  # traced through, round's zero gradient: error 1.0
        opt_mp.step()
        ref_optimizer.step()


def test_each_function_is_one_node_planned_by_its_custom_fwd():
    net, x = _qat()
    model_mp = ampaudit.convert(net, example_inputs=(x,), verify=False)
    rows = {r["node"]: r for r in model_mp.plan if "autograd Function" in r["reason"]}
    fixture = model("straight_through.py")
    assert {name: (r["compute"], r["line"]) for name, r in rows.items()} == {
        "round_ste_apply": ("follows its inputs", line_of(fixture, "return RoundSTE.apply(")),
        "rmsnorm_fn_apply": ("float32", line_of(fixture, "h = RMSNormFn.apply("))}
    assert rows["rmsnorm_fn_apply"]["reason"] == ("custom autograd Function RMSNormFn: its own forward and backward "
                                                 "run, in float32 (custom_fwd(cast_inputs=...))")
    assert "torch.round" not in model_mp.code and "RoundSTE_apply(" in model_mp.code
