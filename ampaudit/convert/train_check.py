"""Verify by training: k optimizer steps of the converted model (fp32 masters, loss scaling)
next to k steps of fp32, on the example inputs, comparing the loss curves.

Comparing outputs at initialisation misses what only training shows: a tied weight that
became two tensors, a parameter the optimizer no longer updates, a loss scale that skips
every step. Both runs work on copies - the user's model and optimizer are untouched - with
the user's optimizer type and hyperparameters, in eval mode (dropout off on both sides, so
the curves are comparable; a BatchNorm that never saw a batch normalises with the batch's
statistics, as training does). The loss is the model's own when it returns one (a scalar, or
``.loss``); otherwise the mean squared error to a fixed random target.

The curves are compared by applied update: a step the loss scaler skipped (an inf/NaN
gradient, as GradScaler skips one after a loss spike) did not change the weights, so the
converted model's k-th applied update is compared with fp32's k-th step. What is judged is
the trend - the gap between the curves over their last quarter, relative to the fp32 loss
there or, when larger, to how far training moved it - not one step: fp16 rounding moves a
single loss by a few percent where a curve is steep or near zero, while a split tie or a
parameter that no longer trains pulls the whole end of the curve away.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ampaudit.convert.low_weights import fp32_copy
from ampaudit.core.dtypes import LowDtype
from ampaudit.core.errors import UsageError
from ampaudit.core.kept_attributes import attributes_kept
from ampaudit.core.paths import display_path
from ampaudit.core.tensors import given_labels, iter_tensors, own_loss
from ampaudit.core.userframe import traceback_location
from ampaudit.graph.forward import ExampleInputs
from ampaudit.graph.model_copy import copy_model

DEFAULT_STEPS = 20
TOLERANCE = {"float16": 2e-2, "bfloat16": 5e-2}  # relative gap of the curves' ends allowed
MIN_STEPS = 8  # fewer applied updates than this say little about a trend: shrink the batch instead
CLI_SECONDS = 60.0  # what the CLI's check may take: a slow model trains fewer steps or fewer rows
MAX_SKIPS = 10  # skipped steps tolerated beyond the planned ones before the check stops trying


@dataclass
class TrainCheck:
    steps: int  # applied updates compared
    fp32: list[float]  # loss before each fp32 step: after k updates
    converted: list[float]  # loss of the converted model after k applied updates (skipped steps left out)
    worst: float  # the judged gap: sum |converted - fp32| / sum |fp32| over the last `window` updates
    tolerance: float
    skipped: int  # steps the loss scaler skipped
    window: int = 0  # how many of the last updates `worst` is judged on
    largest_step: float = 0.0  # the largest relative gap of any one update (not judged)
    reduced: str = ""  # how the time budget shortened the check, in words ("" when it did not)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.worst <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def train_check(model: torch.nn.Module, model_mp: torch.nn.Module, optimizer: torch.optim.Optimizer,
                inputs: ExampleInputs, *, dtype: LowDtype, loss_scale: Any = "auto", steps: int = DEFAULT_STEPS,
                tolerance: float | None = None, budget: float | None = None,
                clock: Callable[[], float] = time.perf_counter) -> TrainCheck:
    """Train copies of ``model`` (fp32) and ``model_mp`` (converted) side by side with copies
    of ``optimizer`` (built on ``model``'s parameters; not modified). ``budget``: seconds the
    check should take at most; the first step is timed, and a slow model trains fewer steps,
    or on a smaller batch where fewer than ``MIN_STEPS`` would fit."""
    start = clock()
    tolerance = tolerance if tolerance is not None else TOLERANCE[dtype.name]
    runs = _Runs(model, model_mp, optimizer, inputs, dtype, loss_scale)
    deadline, batch, rows, per_step = math.inf, _batch_size(inputs), None, 0.0
    if budget is not None and steps > 1:
        begun = clock()
        runs.first_step()
        per_step = clock() - begun
        deadline = start + budget
        wanted = min(steps, MIN_STEPS)
        if batch and per_step * wanted > deadline - clock():  # too slow for a trend: start again on fewer rows
            rows = max(1, int(batch * (deadline - clock()) / (wanted * per_step)))
            if rows < batch:
                runs = _Runs(model, model_mp, optimizer, _first_rows(inputs, rows), dtype, loss_scale)
            else:  # one row already: fewer steps is all there is
                rows = None
    fp32, converted = runs.finish(steps, deadline, clock)
    reduced = ""
    if len(fp32) < steps or rows is not None:
        reduced = " on ".join(([f"{len(fp32)} of {steps} steps"] if len(fp32) < steps else [])
                              + ([f"batch {rows} of {batch}"] if rows is not None else []))
        reduced += f" (a step took {per_step:.2g} s; the check is kept within {budget:g} s)"
    steps = len(fp32)
    window = min(len(converted), max(3, math.ceil(steps / 4)))  # the last quarter, three updates at least
    if len(converted) < len(fp32):  # the loss scale kept skipping: what did not train is a failure
        worst = math.inf
    else:
        worst = _gap(fp32[-window:], converted[-window:], fp32[0])
    largest = max((_relative(a, b) for a, b in zip(fp32, converted, strict=False)), default=0.0)
    return TrainCheck(steps, fp32, converted, worst, tolerance, runs.trial_opt.skipped_steps, window, largest,
                      reduced, clock() - start)


class _Runs:
    """The fp32 copy and the converted copy, each with its optimizer, on the same inputs."""

    def __init__(self, model: torch.nn.Module, model_mp: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 inputs: ExampleInputs, dtype: LowDtype, loss_scale: Any) -> None:
        from ampaudit.convert.optimizer import MixedPrecisionOptimizer

        self.inputs = inputs
        # fp32 copies: a model whose weights are bf16 trains in fp32 from the same values
        self.reference = fp32_copy(model).eval()
        source, self.trial = fp32_copy(model).eval(), copy_model(model_mp).eval()
        self.reference_opt = same_optimizer(optimizer, model, self.reference)
        self.trial_opt = MixedPrecisionOptimizer.from_optimizer(same_optimizer(optimizer, model, source), source,
                                                                self.trial, dtype=dtype.torch, loss_scale=loss_scale)
        self.labelled = given_labels(model.forward, inputs.args, inputs.kwargs)
        # each forward (these steps run in eval mode, for no dropout) leaves the copies' attributes as
        # they were: timm's LeViT caches its attention biases in eval mode, and a cache kept from the
        # target's no-grad forward froze them (fp32), one kept from a step's forward met its freed
        # graph in the next backward (converted)
        with attributes_kept(self.reference), _batch_statistics(self.reference):
            self.target = _target(self.reference, inputs, self.labelled)
        self.fp32: list[float] = []
        self.converted: list[float] = []  # one loss per applied update
        self.attempts = 0

    def first_step(self) -> None:
        self._fp32_step()
        self._converted_step()

    def finish(self, steps: int, deadline: float = math.inf,
               clock: Callable[[], float] = time.perf_counter) -> tuple[list[float], list[float]]:
        """Both runs to ``steps`` losses, or as far as they get by ``deadline`` (two at least).
        A step the scaler skipped is tried again on the same weights; a scale that keeps
        skipping ends the converted run short, with the fp32 curve in full."""
        last = 0.0  # how long the previous step took: the next one is not begun past the deadline
        while len(self.converted) < steps:
            if self.attempts >= steps + MAX_SKIPS:
                while len(self.fp32) < steps:
                    self._fp32_step()
                return self.fp32, self.converted
            begun = clock()
            if len(self.converted) >= 2 and begun + last > deadline:
                break
            if len(self.fp32) <= len(self.converted):
                self._fp32_step()
            self._converted_step()
            last = clock() - begun
        return self.fp32[:len(self.converted)], self.converted

    def _fp32_step(self) -> None:
        with attributes_kept(self.reference), _batch_statistics(self.reference):
            loss = _loss(self.reference(*self.inputs.args, **self.inputs.kwargs), self.target, self.labelled)
        self.reference_opt.zero_grad()
        # eval mode said: HF's RWKV caches its recurrent state in place in eval mode, and that
        # backward fails where training (train mode) would not
        _backward(torch.Tensor.backward, "the model's own backward (in fp32, in eval mode, as the check trains)", loss)
        self.reference_opt.step()
        self.fp32.append(float(loss.detach()))

    def _converted_step(self) -> None:
        self.attempts += 1
        with attributes_kept(self.trial), _batch_statistics(self.trial):
            loss = _loss(self.trial(*self.inputs.args, **self.inputs.kwargs), self.target, self.labelled)
        self.trial_opt.zero_grad()
        _backward(self.trial_opt.backward, "the converted model's backward", loss)
        if self.trial_opt.step():  # applied: the loss was that of the weights after len(converted) updates
            self.converted.append(float(loss.detach()))


def _batch_statistics(model: torch.nn.Module):
    from ampaudit.convert.verify import untrained_norms_use_batch_statistics

    return untrained_norms_use_batch_statistics(model)


def _gap(reference: list[float], values: list[float], start: float) -> float:
    """The area between two stretches of loss curve relative to the area under the first - or,
    when larger, to how far training moved the loss from ``start`` (the first loss): a curve
    that trains down to near zero (an MSE the model can fit) would turn rounding noise between
    two curves that track each other into tens of percent of almost nothing."""
    if not all(math.isfinite(v) for v in values):
        return math.inf
    area = sum(abs(r) for r in reference)
    moved = abs(start - sum(reference) / len(reference)) * len(reference)
    return sum(abs(v - r) for r, v in zip(reference, values, strict=True)) / max(area, moved, 1e-12)


def _batch_size(inputs: ExampleInputs) -> int | None:
    """The leading size every input tensor shares (its batch), or None."""
    sizes = {t.shape[0] for t in iter_tensors((inputs.args, inputs.kwargs)) if t.dim() >= 1}
    return sizes.pop() if len(sizes) == 1 else None


def _first_rows(inputs: ExampleInputs, rows: int) -> ExampleInputs:
    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value[:rows] if value.dim() >= 1 else value
        if isinstance(value, (tuple, list)):
            return type(value)(cut(v) for v in value)
        if isinstance(value, dict):
            return {k: cut(v) for k, v in value.items()}
        return value

    return ExampleInputs(cut(inputs.args), cut(inputs.kwargs), inputs.origin)


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


def _target(model: torch.nn.Module, inputs: ExampleInputs, labelled: bool) -> torch.Tensor | None:
    """None when the model computes its own loss; else a fixed random target like its output."""
    with torch.no_grad():
        output = model(*inputs.args, **inputs.kwargs)
    if own_loss(output, labelled) is not None:
        return None
    first = _first_tensor(output)
    if first is None:
        raise ValueError("the model's output holds no float tensor to train on")
    generator = torch.Generator(device=first.device).manual_seed(0)
    noise = torch.randn(first.shape, generator=generator, device=first.device)
    if not first.any():  # a zero-initialised last layer (DiT's adaLN-Zero): a unit target, as noise prediction's
        return noise
    return noise * float(first.float().std().clamp_min(1e-3))


def _loss(output: Any, target: torch.Tensor | None, labelled: bool) -> torch.Tensor:
    if target is None:
        return own_loss(output, labelled).float()
    return torch.nn.functional.mse_loss(_first_tensor(output).float(), target)


def _relative(reference: float, value: float) -> float:
    if not math.isfinite(value):
        return math.inf
    return abs(value - reference) / max(abs(reference), 1e-8)
