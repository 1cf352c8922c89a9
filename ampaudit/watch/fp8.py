"""``watch(..., fp8=True)``: what a float8 recipe would do to each Linear's GEMM operands, step
by step - torchao's ``Float8Linear`` modules as they run, and plain ``nn.Linear`` layers as a
what-if.

Per (Linear, operand) and step - input and weight cast to e4m3, the gradient of the output
(grad_output) to e5m2, or as a ``Float8Linear``'s config says - a row of ``layout.FP8_FIELDS``:
the step's amax, the scale a tensorwise (current) recipe computes from it (torchao's
``amax_to_scale``: the format's max / amax, in float64 then float32), the scale a delayed recipe
computes from the largest amax of the previous ``history`` steps (TransformerEngine's
``DelayedScaling``, margin 0), how many elements each scale saturates (beyond the format's max:
clamped) or flushes to zero (nonzero, and at most half the smallest subnormal once scaled:
the cast rounds it to 0), and the amax's jump from the previous step.

A separate unit from the fp16 rows (``hooks.StepRecorder``): nothing here runs unless
``fp8=True``. Everything stays on the device until the step boundary: each call adds its
counts into the step's rows, the step's amax enters each row's history there (every step, so
the delayed recipe's history is the run's, also with ``every`` > 1), and a recorded step's
rows are copied to the host without waiting (pinned memory on CUDA); the Monitor reads them
after the step's one read of its own buffer, which has waited for the copy already.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn.modules import module as module_hooks

from ampaudit.core.dtypes import E4M3, E5M2, FP8_FORMATS, LowDtype
from ampaudit.core.tensors import linear_input
from ampaudit.watch.layout import FP8_FIELDS, FP8_OPERANDS, FP8_SUMS

DEFAULT_FORMATS = {"input": E4M3, "weight": E4M3, "grad_output": E5M2}  # torchao's tensorwise recipe
MX_WEIGHT = "MXFP8TrainingWeightWrapperTensor"  # torchao's MXFP8 training wraps a Linear's weight in it
EPS = 1e-12  # torchao's floor under an amax (float8_utils.EPS): an all-zero tensor's scale stays finite
_SUMS = len(FP8_SUMS)
_NAMES = tuple(f.name for f in FP8_FIELDS)
_INTEGER = tuple(f.integer for f in FP8_FIELDS)


def module_formats(module: torch.nn.Module) -> tuple[str, dict[str, LowDtype]]:
    """What a Linear is, and the format each operand is cast to: a torchao ``Float8Linear``'s
    own config (its scaling granularity named; the statistics are per tensor), else the
    tensorwise recipe's, as a what-if."""
    config = getattr(module, "config", None)
    if type(getattr(module, "weight", None)).__name__ == MX_WEIGHT:
        # torchao's MXFP8 training: e4m3 everywhere, one scale per 32 elements; the rows are per tensor
        return "MXFP8 (per-tensor statistics)", dict.fromkeys(FP8_OPERANDS, E4M3)
    if type(module).__name__ != "Float8Linear" or config is None:
        return "Linear (what-if)", dict(DEFAULT_FORMATS)
    formats, granularity = {}, "tensorwise"
    for operand in FP8_OPERANDS:
        cast = getattr(config, f"cast_config_{operand}", None)
        short = str(getattr(cast, "target_dtype", "")).removeprefix("torch.")
        formats[operand] = next((f for f in FP8_FORMATS.values() if f.name == short), DEFAULT_FORMATS[operand])
        kind = getattr(getattr(cast, "scaling_granularity", None), "value", None)
        if isinstance(kind, str) and kind != "tensorwise":
            granularity = kind
    return f"Float8Linear ({granularity})", formats


class _Rows:
    """The device state of one device's rows: each row's amax history and the previous step's
    amax, and this step's calls - their amax and counts, added into the rows at the step's end
    (one kernel each, not a few per call). Grows when a new (module, operand) first runs."""

    def __init__(self, device: torch.device, history: int) -> None:
        self.device, self.history = device, history
        self.hist = torch.zeros(0, history, dtype=torch.float32, device=device)  # 0: no entry yet
        self.ptr = torch.zeros(0, dtype=torch.int64, device=device)  # each row's next history slot
        self.prev = torch.zeros(0, dtype=torch.float32, device=device)  # the previous step's amax (0: none)
        self.fmax = torch.zeros(0, dtype=torch.float64, device=device)  # each row's format's max
        self.calls: list[int] = []  # this step's calls: their rows, in order
        self.amaxes: list[torch.Tensor] = []  # each call's amax
        self.counts: list[torch.Tensor] = []  # a recorded step's calls: numel and FP8_SUMS' counts
        self.delayed: torch.Tensor | None = None  # per row, the delayed recipe's scale this step (0: none)
        self._index: dict[tuple[int, ...], torch.Tensor] = {}  # rows as an index tensor, made once

    def grow(self, fmax: float) -> int:
        def more(t: torch.Tensor, value: float = 0.0) -> torch.Tensor:
            return torch.cat([t, torch.full((1, *t.shape[1:]), value, dtype=t.dtype, device=self.device)])

        self.hist, self.ptr, self.prev = more(self.hist), more(self.ptr), more(self.prev)
        self.fmax = more(self.fmax, fmax)
        self.delayed = None
        return len(self.prev) - 1

    def delayed_scale(self, r: int) -> torch.Tensor:
        """Row ``r``'s delayed scale this step, from the history before it (0: no history)."""
        if self.delayed is None:  # once a step, for every row
            hist = self.hist.max(1).values
            self.delayed = torch.where(hist > 0, to_scale(hist, self.fmax), 0.0)
        return self.delayed[r]

    def index(self, rows: tuple[int, ...]) -> torch.Tensor:
        """The rows as a device tensor, made once per sequence of rows; on CUDA copied from
        pinned memory without waiting (a copy from pageable memory would wait for the stream)."""
        found = self._index.get(rows)
        if found is None:
            if len(self._index) > 64:  # calls that vary from step to step: keep it bounded
                self._index.clear()
            host = torch.tensor(rows, dtype=torch.int64)
            found = self._index[rows] = (host.pin_memory().to(self.device, non_blocking=True)
                                         if self.device.type == "cuda" else host.to(self.device))
        return found


class Fp8Step:
    """A recorded step's fp8 rows, on their way to the host."""

    def __init__(self, names: list[tuple[str, str]], host: torch.Tensor, event: Any) -> None:
        self.names, self.host, self.event = names, host, event

    def read(self, kinds: dict[str, str], formats: dict[str, dict[str, LowDtype]]) -> dict[str, Any]:
        """``{module: {"kind": ..., operand: {"format": "e4m3", field: value, ...}}}``."""
        if self.event is not None:
            self.event.synchronize()  # done already: the step's own read waited for the stream
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for (module, operand), values in zip(self.names, self.host.tolist(), strict=True):
            row: dict[str, Any] = {"format": formats[module][operand].short}
            for name, integer, value in zip(_NAMES, _INTEGER, values, strict=True):
                row[name] = int(value) if integer else value
            rows[(module, operand)] = row
        out: dict[str, Any] = {}
        for module in sorted({m for m, _ in rows}):  # the operands in the GEMM's order
            out[module] = {"kind": kinds[module], **{op: rows[(module, op)] for op in FP8_OPERANDS
                                                     if (module, op) in rows}}
        return out


class Fp8Recorder:
    """Hooks on every ``nn.Linear`` (``Float8Linear`` is one) of ``model``, or, with
    ``model=None``, on every one that runs forward; ``name`` names a module (the StepRecorder's
    names), ``skip`` says when a call is not the run's data (a replay, a compiled region's
    tracing). ``history``: the delayed recipe's amax history length, in steps."""

    def __init__(self, history: int, name: Any, skip: Any, here: Any = lambda: True) -> None:
        # ``here``: whether a forward is the run's (the followed thread, outside torch.func
        # transforms); asked in forward only: gradient hooks may run on autograd's own thread
        self.history, self._name, self._skip, self._here = history, name, skip, here
        self.logging = True  # this step's counts are recorded (amax always is: the history needs it)
        self._devices: dict[torch.device, _Rows] = {}
        self._rows: dict[tuple[str, str], tuple[torch.device, int]] = {}  # (module, operand) -> its row
        self.kinds: dict[str, str] = {}  # module -> "Float8Linear (tensorwise)" / "Linear (what-if)"
        self.formats: dict[str, dict[str, LowDtype]] = {}
        self._handles: list[Any] = []

    def attach(self, model: torch.nn.Module | None) -> None:
        if model is not None:
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    # with kwargs: ``fc(input=x)`` passes its input by keyword
                    self._handles.append(module.register_forward_hook(self._after_forward, with_kwargs=True))
        else:
            self._handles.append(module_hooks.register_module_forward_hook(self._global_after_forward,
                                                                           with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _global_after_forward(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if isinstance(module, torch.nn.Linear):
            self._after_forward(module, args, kwargs, output)

    def _after_forward(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if (not self._handles or torch.compiler.is_compiling() or not torch.is_grad_enabled() or self._skip()
                or not self._here()):
            return
        name = self._name(module)
        if name is None:
            return
        if name not in self.kinds:
            self.kinds[name], self.formats[name] = module_formats(module)
        x = linear_input(args, kwargs)
        if x is not None and x.is_floating_point():
            self.measure(name, "input", x)
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            self.measure(name, "weight", weight.to_local() if hasattr(weight, "to_local") else weight)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            def hook(grad: torch.Tensor | None) -> None:
                if grad is not None and self._handles and not self._skip():
                    self.measure(name, "grad_output", grad)

            output.register_hook(hook)

    def measure(self, module: str, operand: str, tensor: torch.Tensor) -> None:
        """One call's operand: its amax and, on a recorded step, its counts, kept on the
        device for the step's end. No host sync."""
        if tensor.numel() == 0 or tensor.layout != torch.strided or tensor.is_meta:
            return
        fmt = self.formats[module][operand]
        key = (module, operand)
        where = self._rows.get(key)
        if where is None or where[0] != tensor.device:
            rows = self._devices.get(tensor.device)
            if rows is None:
                rows = self._devices[tensor.device] = _Rows(tensor.device, self.history)
            where = self._rows[key] = (tensor.device, rows.grow(fmt.max))
        device, r = where
        rows = self._devices[device]
        with torch.no_grad():
            a = tensor.detach().abs()
            a = (a if a.dtype == torch.float32 else a.float()).reshape(-1)
            amax = a.max()
            rows.calls.append(r)
            rows.amaxes.append(amax)
            if self.logging:
                scale = to_scale(amax, fmt.max)
                delayed = rows.delayed_scale(r)
                delayed = torch.where(delayed > 0, delayed, scale)  # no history yet: the step's own amax
                # the order of layout.FP8_SUMS; numel by a fill, not a copy from the host (it would wait)
                nonzero = torch.count_nonzero(a)
                y = a * delayed
                rows.counts.append(torch.stack([
                    torch.full((), a.numel(), dtype=torch.int64, device=device), flushed(a * scale, nonzero, fmt),
                    saturated(y, fmt), flushed(y, nonzero, fmt)]))

    def end_step(self, logging_next: bool) -> Fp8Step | None:
        """The step's calls added into their rows; the step's amax into each row's history; a
        recorded step's rows on their way to the host (``Fp8Step.read`` after the step's own
        read). On the device only."""
        logged, pending = self.logging, []
        names_by_row = {v: k for k, v in self._rows.items()}
        for device, rows in self._devices.items():
            if not rows.calls:
                continue
            seen = tuple(sorted(set(rows.calls), key=lambda r: names_by_row[(device, r)]))
            idx, calls = rows.index(seen), rows.index(tuple(rows.calls))
            amax = torch.zeros(len(rows.prev), dtype=torch.float32, device=device)
            amax = amax.scatter_reduce(0, calls, torch.stack(rows.amaxes), "amax")[idx]
            if logged and rows.counts:
                sums = torch.zeros(len(rows.prev), len(rows.counts[0]), dtype=torch.float64, device=device)
                sums = sums.index_add(0, calls, torch.stack(rows.counts).double())[idx]
                hist_amax = rows.hist[idx].max(1).values
                fmax = rows.fmax[idx]
                scale = to_scale(amax, fmax)
                delayed = torch.where(hist_amax > 0, to_scale(hist_amax, fmax), scale)
                prev = rows.prev[idx]
                jump = torch.where(prev > 0, amax / prev.clamp(min=EPS), 0.0)
                out = torch.cat([sums, torch.stack([amax, jump, hist_amax, scale, delayed], 1).double()], 1)
                pending.append(([names_by_row[(device, r)] for r in seen], out))
            # the step's amax enters the history and becomes the previous one; rows not run keep theirs
            ptr = rows.ptr[idx]
            rows.hist[idx, ptr] = amax
            rows.ptr[idx] = (ptr + 1) % self.history
            rows.prev[idx] = amax
            rows.calls, rows.amaxes, rows.counts, rows.delayed = [], [], [], None
        self.logging = logging_next
        if not pending:
            return None
        names = [n for names, _ in pending for n in names]
        out = torch.cat([o.to(pending[0][1].device) for _, o in pending])  # several devices: rare
        event = None
        if out.is_cuda:
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            out = host
        return Fp8Step(names, out, event)


def to_scale(amax: torch.Tensor, fmax: float | torch.Tensor) -> torch.Tensor:
    """torchao's ``amax_to_scale``: max / amax floored at EPS, in float64, as float32."""
    return (fmax / amax.double().clamp(min=EPS)).float()


_CUTS: dict[str, tuple[float, float]] = {}


def cuts(fmt: LowDtype) -> tuple[float, float]:
    """The smallest fp32 magnitude ``fmt``'s cast (round to nearest even) takes past its max -
    a saturated cast clamps from there; the max's own rounding (up to half an ulp above it)
    is not saturation - and the largest it rounds to zero. Found once, from the cast itself
    (an fp32 bit search), so the counts are the cast's."""
    found = _CUTS.get(fmt.name)
    if found is None:
        target = getattr(torch, fmt.name, None)
        if target is None:  # a torch without float8 dtypes: the limits' arithmetic
            found = (fmt.overflow_at, fmt.tiniest / 2)
        else:
            def first(lo: int, hi: int, bad: Any) -> int:  # the first fp32 bit pattern in [lo, hi] that is bad
                while lo < hi:
                    mid = (lo + hi) // 2
                    lo, hi = (lo, mid) if bad(mid) else (mid + 1, hi)
                return lo

            def cast(bits: int) -> float:
                return torch.tensor([bits], dtype=torch.int32).view(torch.float32).to(target).float().item()

            def as_float(bits: int) -> float:
                return torch.tensor([bits], dtype=torch.int32).view(torch.float32).item()

            top = 0x7F7FFFFF  # fp32's max
            saturate = first(0, top, lambda b: not math.isfinite(cast(b)))
            # torch's e4m3fn cast saturates by itself (it never gives NaN): from past the tie
            # between the max and the next step up, which rounds to even - the max
            tie = torch.tensor(fmt.overflow_at, dtype=torch.float32)  # the next fp32 up: a comparison in fp32
            found = (as_float(saturate) if saturate < top else torch.nextafter(tie, tie + 1).item(),
                     as_float(first(0, top, lambda b: cast(b) != 0) - 1))
        _CUTS[fmt.name] = found
    return found


def saturated(y: torch.Tensor, fmt: LowDtype) -> torch.Tensor:
    """Of |x| times a scale (fp32, as the recipe computes it), how many the cast takes past the
    format's max: a saturated cast clamps them. (A tensorwise scale never does: amax times
    max / amax is within 2**-22 of the max, far from where the cast goes past it - so watch
    counts it for the delayed scale only.)"""
    return torch.count_nonzero(y >= cuts(fmt)[0])


def flushed(y: torch.Tensor, nonzero: torch.Tensor, fmt: LowDtype) -> torch.Tensor:
    """Of |x| times a scale, how many nonzero ones the cast rounds to zero: the nonzero ones
    (``nonzero``) less those it keeps - counted without a bool-to-int copy."""
    return nonzero - torch.count_nonzero(y > cuts(fmt)[1])
