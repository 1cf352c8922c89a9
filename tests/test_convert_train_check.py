"""The training check (convert/train_check.py): curves compared by applied update, the trend
judged rather than one step, both curves shown on failure, and the CLI's time budget."""

from __future__ import annotations

import itertools

import pytest
import torch

import ampaudit
from ampaudit.convert.optimizer import MixedPrecisionOptimizer
from ampaudit.convert.train_check import _first_rows, _gap, train_check
from ampaudit.core.dtypes import LowDtype
from ampaudit.load.loader import load_target
from tests.conftest import model

FP16 = LowDtype.parse("float16")


def _converted(name: str):
    torch.manual_seed(0)
    loaded = load_target(model(name))
    return loaded.model, ampaudit.convert(loaded.model, loaded.inputs, train_steps=0), loaded.inputs


def _text(out: str) -> str:
    """The summary's words, its border and line breaks left out."""
    return " ".join(word for word in out.split() if word != "│")


def _skip_attempt(monkeypatch, attempt: int) -> None:
    """The converted model's ``attempt``-th step finds an inf gradient (as after a loss spike)."""
    real, calls = MixedPrecisionOptimizer.unscale_, []

    def unscale_(self):
        found = real(self)
        if self._unscaled is not None and len(calls) < attempt:
            calls.append(self)
            if len(calls) == attempt:
                self._unscaled = True
                return True
        return found

    monkeypatch.setattr(MixedPrecisionOptimizer, "unscale_", unscale_)


def test_a_skipped_step_is_compared_by_applied_update(monkeypatch):
    # a static scale: the skip changes nothing but the step it drops, so the k-th applied
    # update of the run with a skip is the k-th of the run without one, bit for bit
    fp32_model, model_mp, inputs = _converted("torchvision_style.py")

    def run():
        optimizer = torch.optim.AdamW(fp32_model.parameters(), lr=1e-3)
        return train_check(fp32_model, model_mp, optimizer, inputs, dtype=FP16, loss_scale=1024.0, steps=8)

    clean = run()
    _skip_attempt(monkeypatch, 3)
    skipped = run()
    assert (clean.skipped, skipped.skipped) == (0, 1)
    assert skipped.converted == clean.converted and skipped.fp32 == clean.fp32 and len(skipped.converted) == 8
    assert skipped.worst == clean.worst and skipped.passed


def test_the_cli_check_passes_a_resnet_whose_scaler_skips_a_step(cli, tmp_path, monkeypatch):
    # GradScaler's dynamic scale skips the step after AdamW's first-step loss spike; compared
    # step by step, the converted curve was fp32's one step late and the check failed
    _skip_attempt(monkeypatch, 3)
    result = cli("convert", model("torchvision_style.py"), "-o", tmp_path / "out")
    assert result.code == 0, result.out
    assert "training check  20 steps: loss" in result.out
    assert "1 step skipped by the loss scale, compared by applied update" in _text(result.out)


def test_a_parameter_the_converted_model_no_longer_trains_still_fails():
    # the head of the converted model frozen: its outputs match fp32 at initialisation, but
    # its curve leaves fp32's as soon as training moves the head
    fp32_model, model_mp, inputs = _converted("torchvision_style.py")
    optimizer = torch.optim.AdamW(fp32_model.parameters(), lr=1e-3)
    healthy = train_check(fp32_model, model_mp, optimizer, inputs, dtype=FP16)
    model_mp.fc.weight.requires_grad_(False)
    model_mp.fc.bias.requires_grad_(False)
    frozen = train_check(fp32_model, model_mp, optimizer, inputs, dtype=FP16)
    assert healthy.passed and healthy.worst < 5e-3
    assert not frozen.passed and frozen.worst > 0.1 and frozen.fp32 == healthy.fp32


def test_the_check_keeps_within_its_budget_with_fewer_steps_or_rows():
    # a clock that moves `tick` seconds each time it is read: every step looks as slow as the
    # tick says, whatever the machine's load (the check reads it twice a step)
    fp32_model, model_mp, inputs = _converted("unet_style.py")
    optimizer = torch.optim.AdamW(fp32_model.parameters(), lr=1e-3)

    def ticking(tick: float):
        ticks = itertools.count()
        return lambda: next(ticks) * tick

    full = train_check(fp32_model, model_mp, optimizer, inputs, dtype=FP16, budget=60.0)
    assert full.reduced == "" and full.steps == 20  # a few milliseconds a step: nothing to shorten
    slow = train_check(fp32_model, model_mp, optimizer, inputs, dtype=FP16, budget=60.0, clock=ticking(4.0))
    assert slow.reduced == f"{slow.steps} of 20 steps (a step took 4 s; the check is kept within 60 s)"
    assert slow.passed and len(slow.fp32) == len(slow.converted) == slow.steps >= 2
    # no step begun where the last one says it would end past 60 s: past it by at most the
    # clock's own reads (two ticks: between two steps, and the check's last reading)
    assert 60 - 4 <= slow.seconds <= 60 + 2 * 4
    slower = train_check(fp32_model, model_mp, optimizer, inputs, dtype=FP16, budget=60.0, clock=ticking(30.0))
    assert "batch 1 of 2" in slower.reduced and slower.steps >= 2
    assert slower.fp32[0] != full.fp32[0]  # trained on the first row only
    one_row = _first_rows(inputs, 1)  # nothing to shrink: fewer steps only, and no second start
    alone = train_check(fp32_model, model_mp, optimizer, one_row, dtype=FP16, budget=60.0, clock=ticking(30.0))
    assert alone.reduced.startswith(f"{alone.steps} of 20 steps (a step took") and alone.steps >= 2


@pytest.mark.parametrize("name", ["unet_style.py", "unet_style.py:bilinear_model",
                                  "torchvision_style.py:bottleneck_model"])
def test_unet_and_bottleneck_resnet_pass_the_cli_check(cli, tmp_path, name):
    result = cli("convert", model(name), "-o", tmp_path / "out")
    assert result.code == 0, result.out
    assert "training check  20 steps" in result.out and "(within 2%)" in result.out


def test_the_gap_of_curves_that_train_to_near_zero_is_judged_against_how_far_they_moved():
    # ViT from ViTConfig (MSE to a random target) under fp8 vs bf16: the curves track each other
    # step by step from 3e-3 down to 4e-4, and relative to the end's loss alone were "17.9% apart"
    bf16 = [3.058e-3, 3.403e-2, 4.582e-3, 1.741e-3, 6.531e-3, 6.172e-3, 3.4e-3, 1.101e-3, 2.023e-4, 5.282e-4,
            1.289e-3, 1.77e-3, 1.751e-3, 1.336e-3, 8.068e-4, 3.708e-4, 1.376e-4, 1.192e-4, 2.388e-4, 4.249e-4]
    fp8 = [2.989e-3, 3.246e-2, 3.78e-3, 2.298e-3, 7.154e-3, 5.926e-3, 3.022e-3, 7.456e-4, 1.421e-4, 6.065e-4,
           1.36e-3, 1.813e-3, 1.729e-3, 1.216e-3, 7.289e-4, 3.097e-4, 9.518e-5, 1.225e-4, 2.986e-4, 4.891e-4]
    gap = sum(abs(a - b) for a, b in zip(bf16[-5:], fp8[-5:], strict=True))
    assert gap / sum(bf16[-5:]) == pytest.approx(0.179, abs=1e-3)  # the old judgement: past 5%
    assert _gap(bf16[-5:], fp8[-5:], bf16[0]) == pytest.approx(gap / (5 * (bf16[0] - sum(bf16[-5:]) / 5)))
    assert _gap(bf16[-5:], fp8[-5:], bf16[0]) < 0.02
    # a curve that stays where it started (a parameter that no longer trains) is still far off
    assert _gap(bf16[-5:], [bf16[0]] * 5, bf16[0]) > 0.5
    # a curve that barely moved is judged against its own loss, as before
    assert _gap([1.0, 0.99, 0.98], [1.02, 1.01, 1.0], 1.05) == pytest.approx(0.06 / 2.97)


def test_a_scale_that_skips_every_step_fails_in_one_line(cli, tmp_path, monkeypatch):
    # every gradient inf at every scale (a fresh spectral-norm discriminator's 1e11 outputs did
    # this): no update to compare, where the summary indexed the empty curve and crashed
    real = MixedPrecisionOptimizer.unscale_

    def unscale_(self):
        real(self)
        self._unscaled = True
        return True

    monkeypatch.setattr(MixedPrecisionOptimizer, "unscale_", unscale_)
    result = cli("convert", model("torchvision_style.py"), "--train-steps", "4", "-o", tmp_path / "out")
    assert result.code == 1, result.err
    assert "training check FAILED: no update applied - the loss scale skipped all 14 steps tried (inf/NaN " \
           "gradients at every scale); fp32's loss started at" in _text(result.out)


@pytest.mark.parametrize("backend", ["fx", "modules"])
def test_a_cache_an_eval_forward_fills_is_made_again_each_step(backend):
    # timm's LeViT caches its attention biases in a dict in eval mode, the mode the check trains
    # in: the fp32 copy kept the target's no-grad biases (they never trained: its curve was not
    # the model's), and the modules backend's copy the first step's (its second backward raised)
    import copy

    from fixtures.models import cached_attention_bias

    torch.manual_seed(0)
    net, x = cached_attention_bias.get_model().eval(), cached_attention_bias.example_inputs()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    model_mp, _ = ampaudit.convert(net, optimizer, example_inputs=x, backend=backend, train_steps=3)
    by_hand = copy.deepcopy(net).train()  # train mode: no cache, the biases train
    with torch.no_grad():
        output = by_hand(*x)
    target = torch.randn(output.shape, generator=torch.Generator().manual_seed(0)) * float(output.std())
    adamw, losses = torch.optim.AdamW(by_hand.parameters(), lr=1e-3), []
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(by_hand(*x), target)
        adamw.zero_grad()
        loss.backward()
        adamw.step()
        losses.append(float(loss))
    assert model_mp.summary.train["fp32"] == losses  # bit for bit
    assert model_mp.summary.train["passed"] and net.attn.attention_bias_cache == {}
