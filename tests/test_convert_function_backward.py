"""convert's modules backend runs a custom autograd Function's backward under the autocast its
forward ran in (convert/function_backward.py): a recomputing checkpoint shaped like
improved-diffusion's (fixtures/models/recompute_checkpoint.py) breaks under plain autocast and
broke the converted model's training check."""

from __future__ import annotations

import threading

import pytest
import torch

import ampaudit
from ampaudit.convert.function_backward import backward_as_forward
from ampaudit.load.loader import load_target
from tests.conftest import model

APPLY = torch.autograd.Function.__dict__["apply"]


def _unet():
    loaded = load_target(model("recompute_checkpoint.py"))
    return loaded.model.train(), loaded.inputs.args


def test_the_recomputing_checkpoint_breaks_under_plain_autocast():
    unet, (x, t) = _unet()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = unet(x, t).float().square().mean()
    with pytest.raises(RuntimeError, match="should be the same"):
        loss.backward()


@pytest.mark.parametrize("weights", ["low", "fp32"])
def test_the_converted_model_trains_through_it_with_fp32s_gradients(weights):
    unet, (x, t) = _unet()
    optimizer = torch.optim.SGD(unet.parameters(), lr=0.01)
    trained, _ = ampaudit.convert(unet, optimizer, example_inputs=(x, t), weights=weights, train_steps=4)
    assert trained.summary.backend == "modules" and trained.summary.train is not None  # its backward ran
    model_mp = ampaudit.convert(unet, (x, t), weights=weights).train()
    model_mp(x, t).float().square().mean().backward()
    assert torch.autograd.Function.__dict__["apply"] is APPLY  # put back once the forward ended
    reference = load_target(model("recompute_checkpoint.py")).model.train()
    reference(x, t).square().mean().backward()
    grads = dict(reference.named_parameters())
    for name, p in model_mp.named_parameters():
        want = grads[name].grad
        rel = float((p.grad.float() - want).norm() / want.norm())
        assert rel < 2e-2, (name, rel)  # float16 rounding, not a gradient of other ops


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _Scale.seen.append(torch.is_autocast_enabled("cpu"))
        return grad * 2


class _ScaleSetup(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        _Scale.seen.append(torch.is_autocast_enabled("cpu"))
        return grad * 2


class _ScaleCustomBwd(_Scale):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x):
        return x * 2

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        _Scale.seen.append(("custom_bwd", torch.is_autocast_enabled("cpu")))
        return grad * 2


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("function", [_Scale, _ScaleSetup])
def test_a_functions_backward_enters_again_what_its_forward_ran_in(function):
    _Scale.seen = []
    x = torch.ones(3, requires_grad=True)
    with _autocast(), backward_as_forward(_autocast):
        y = function.apply(x)
    assert type(y.grad_fn).__name__.startswith(function.__name__)
    y.sum().backward()
    assert _Scale.seen == [True] and torch.equal(x.grad, torch.full((3,), 2.0))
    with _autocast():
        z = function.apply(x)
    z.sum().backward()
    assert _Scale.seen == [True, False]  # outside the block: the Function as written


def test_custom_bwd_and_other_threads_are_left_alone():
    _Scale.seen = []
    x = torch.ones(3, requires_grad=True)
    with _autocast(), backward_as_forward(_autocast):
        _ScaleCustomBwd.apply(x).sum().backward()
        other = []
        thread = threading.Thread(target=lambda: other.append(_Scale.apply(x)))
        thread.start()
        thread.join()
    other[0].sum().backward()
    assert _Scale.seen == [("custom_bwd", True), False]
    assert torch.autograd.Function.__dict__["apply"] is APPLY
