"""Verify by training: k optimizer steps of the converted model (fp32 masters, loss scaling)
next to k steps of fp32, on the example inputs, comparing the loss curves.

Comparing outputs at initialisation misses what only training shows: a tied weight that
became two tensors, a parameter the optimizer no longer updates, a loss scale that skips
every step. Both runs work on copies - the user's model and optimizer are untouched - with
the user's optimizer type and hyperparameters, in eval mode (dropout off on both sides, so
the curves are comparable). The loss is the model's own when it returns one (a scalar, or
``.loss``); otherwise the mean squared error to a fixed random target.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ampaudit.convert.low_weights import fp32_copy
from ampaudit.core.dtypes import LowDtype
from ampaudit.core.errors import UsageError
from ampaudit.core.paths import display_path
from ampaudit.core.tensors import iter_tensors
from ampaudit.core.userframe import traceback_location
from ampaudit.graph.forward import ExampleInputs

DEFAULT_STEPS = 20
TOLERANCE = {"float16": 2e-2, "bfloat16": 5e-2}  # relative loss difference allowed at any step


@dataclass
class TrainCheck:
    steps: int
    fp32: list[float]  # loss per step
    converted: list[float]
    worst: float  # largest relative difference of the two losses over the steps
    tolerance: float
    skipped: int  # steps the loss scaler skipped

    @property
    def passed(self) -> bool:
        return self.worst <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def train_check(model: torch.nn.Module, model_mp: torch.nn.Module, optimizer: torch.optim.Optimizer,
                inputs: ExampleInputs, *, dtype: LowDtype, loss_scale: Any = "auto", steps: int = DEFAULT_STEPS,
                tolerance: float | None = None) -> TrainCheck:
    """Train copies of ``model`` (fp32) and ``model_mp`` (converted) side by side with copies
    of ``optimizer`` (built on ``model``'s parameters; not modified)."""
    from ampaudit.convert.optimizer import MixedPrecisionOptimizer

    # fp32 copies: a model whose weights are bf16 trains in fp32 from the same values
    reference, source, trial = fp32_copy(model).eval(), fp32_copy(model).eval(), copy.deepcopy(model_mp).eval()
    reference_opt = same_optimizer(optimizer, model, reference)
    trial_opt = MixedPrecisionOptimizer.from_optimizer(same_optimizer(optimizer, model, source), source, trial,
                                                       dtype=dtype.torch, loss_scale=loss_scale)
    target = _target(reference, inputs)
    fp32, converted = [], []
    for _ in range(steps):
        loss = _loss(reference(*inputs.args, **inputs.kwargs), target)
        reference_opt.zero_grad()
        _backward(torch.Tensor.backward, "the model's own backward (in fp32)", loss)
        reference_opt.step()
        fp32.append(float(loss.detach()))
        loss_mp = _loss(trial(*inputs.args, **inputs.kwargs), target)
        trial_opt.zero_grad()
        _backward(trial_opt.backward, "the converted model's backward", loss_mp)
        trial_opt.step()
        converted.append(float(loss_mp.detach()))
    worst = max((_relative(a, b) for a, b in zip(fp32, converted, strict=True)), default=0.0)
    return TrainCheck(steps, fp32, converted, worst, tolerance if tolerance is not None else TOLERANCE[dtype.name],
                      trial_opt.skipped_steps)


def _backward(run: Any, what: str, loss: torch.Tensor) -> None:
    """``run(loss)``, a backward of the training check; when the model's code fails in it, one
    line naming the error and the user's line (it is the model's, not ampaudit's)."""
    try:
        run(loss)
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
        where = traceback_location(exc.__traceback__)
        at = f" ({display_path(where.file)}:{where.line})" if where is not None else ""
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UsageError(f"the training check failed in {what}: {type(exc).__name__}: {text}{at}; pass "
                         "--train-steps 0 (train_steps=0) to convert without it") from exc


def same_optimizer(optimizer: torch.optim.Optimizer, owner: torch.nn.Module,
                   other: torch.nn.Module) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s type and groups over ``other``'s parameters (``other``
    a copy of ``owner``, which ``optimizer`` was built on), with fresh state."""
    names = {id(p): name for name, p in owner.named_parameters(remove_duplicate=False)}
    params = dict(other.named_parameters(remove_duplicate=False))
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [params[names[id(p)]] for p in group["params"] if id(p) in names]}
              for group in optimizer.param_groups]
    return type(optimizer)(groups)


def _first_tensor(value: Any) -> torch.Tensor | None:
    return next((t for t in iter_tensors(value) if t.is_floating_point()), None)


def _own_loss(output: Any) -> torch.Tensor | None:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = _first_tensor(output)
    return first if first is not None and first.numel() == 1 else None


def _target(model: torch.nn.Module, inputs: ExampleInputs) -> torch.Tensor | None:
    """None when the model computes its own loss; else a fixed random target like its output."""
    with torch.no_grad():
        output = model(*inputs.args, **inputs.kwargs)
    if _own_loss(output) is not None:
        return None
    first = _first_tensor(output)
    if first is None:
        raise ValueError("the model's output holds no float tensor to train on")
    generator = torch.Generator(device=first.device).manual_seed(0)
    noise = torch.randn(first.shape, generator=generator, device=first.device)
    return noise * float(first.float().std().clamp_min(1e-3))


def _loss(output: Any, target: torch.Tensor | None) -> torch.Tensor:
    if target is None:
        return _own_loss(output).float()
    return torch.nn.functional.mse_loss(_first_tensor(output).float(), target)


def _relative(reference: float, value: float) -> float:
    if not math.isfinite(value):
        return math.inf
    return abs(value - reference) / max(abs(reference), 1e-8)
