"""Runtime hooks: per-module forward/backward statistics, parameter gradients, loss scale,
and the first module that went non-finite - with at most one host sync per logged step.

Hooks only fill rows of a preallocated device arena (one kernel per tensor, ``stats``); the
step boundary (an optimizer step, a GradScaler update, or ``mon.step()``) reduces the rows
into one buffer on the device and reads it back once.
The first non-finite event is found on the device too: each event gets a sequence number
on the host, and the device keeps the smallest one whose tensor held NaN or Inf.
"""

from __future__ import annotations

import json
import sys
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks

from ampaudit.core.arguments import require_module
from ampaudit.core.dtypes import FLOAT16, LowDtype
from ampaudit.core.errors import AmpauditError
from ampaudit.watch import arena, stats
from ampaudit.watch.arena import RowArena
from ampaudit.watch.layout import LAYOUT
from ampaudit.watch.log_file import create_log
from ampaudit.watch.summary import SummaryBuilder

NO_EVENT = 2**62  # "no non-finite tensor yet" on the device


class NonFiniteError(AmpauditError):
    """Raised at the step boundary with ``stop_on_nonfinite=True``."""

    exit_code = 1


def stop_reason(record: dict[str, Any], skips_in_row: int, stop_after_skips: int) -> str | None:
    """Why ``stop_on_nonfinite`` stops after this step, or None. Without a GradScaler any
    non-finite value stops. With one, a non-finite gradient on a step the scaler skips is the
    scaler doing its job (an init scale too high, a rare spike): it stops only on what the
    scale cannot fix - non-finite values in the forward, a scale below 1, or
    ``stop_after_skips`` skipped steps in a row."""
    first, scale = record["first_nonfinite"], record["scale"]
    where = (f"first in {first['module']} ({first['phase']}, {first['tensor']}) at step {first['step']}"
             if first is not None else "")
    if scale is None:
        return f"non-finite values {where}" if first is not None else None
    if first is not None and first["phase"] == "forward":
        return f"non-finite values in the forward, which no loss scale fixes: {where}"
    if scale < 1:
        return f"the loss scale fell to {scale:g} at step {record['step']}: the gradients overflow at any scale"
    if skips_in_row >= stop_after_skips:
        return f"{skips_in_row} steps in a row skipped by the loss scaler (up to step {record['step']})"
    return None


def unmeasurable(t: torch.Tensor) -> str | None:
    """Why watch cannot measure a float tensor (its kind), or None: the row kernels read a
    dense, strided buffer with values."""
    if t.is_nested:
        return "nested"
    if t.layout != torch.strided:
        return "sparse"
    if t.is_meta:
        return "meta"
    return None


def _tensors(value: Any, limit: int = 8, skipped: Counter | None = None) -> list[torch.Tensor]:
    """Measurable float tensors in a module output (a tensor, or a tuple/list/dict of them);
    the others are counted in ``skipped`` by kind, never measured (complex and quantized
    tensors are not floating point: not counted)."""
    items = [value] if isinstance(value, torch.Tensor) else \
        value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
    found = []
    for item in items:
        if isinstance(item, torch.Tensor) and item.is_floating_point():
            kind = unmeasurable(item)
            if kind is None:
                found.append(item)
            elif skipped is not None:
                skipped[kind] += 1
        if len(found) >= limit:
            break
    return found


class Monitor:
    """Hooks on ``model`` (or, with ``model=None``, on every module that runs forward and every
    optimizer that steps: ``ampaudit run``). Steps end at ``optimizer.step()``, at
    ``scaler.update()`` when a GradScaler is given, or at ``step()``; every ``every``-th one
    is recorded, audited against ``dtype``, and written to ``log`` (JSON lines) if given.
    Use as a context manager, or ``start()`` / ``stop()``; read ``summary()`` or ``print()``."""

    def __init__(self, model: torch.nn.Module | None = None, *, optimizer: torch.optim.Optimizer | None = None,
                 scaler: torch.amp.GradScaler | None = None, log: str | Path | None = None, every: int = 1,
                 dtype: LowDtype | torch.dtype | str | None = None, stop_on_nonfinite: bool = False,
                 inputs: bool = False, stop_after_skips: int = 10, eval: bool = False) -> None:
        require_module(model, "ampaudit.watch", optional=True)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a whole number >= 1 (got {every!r})")
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.every, self.stop_on_nonfinite, self.record_inputs = every, stop_on_nonfinite, inputs
        self.stop_after_skips = stop_after_skips
        self._skips_in_row = 0
        self._stopping = False
        self._closure_steps = 0  # optimizer.step(closure) calls in progress
        self._last_scaler: torch.amp.GradScaler | None = None
        self.record_eval = eval  # grad-disabled forwards: phase "eval" (True) or not recorded (False)
        self.eval_forwards = 0  # the model's grad-disabled calls
        self.unmeasured: Counter[str] = Counter()  # tensors skipped, by kind (sparse, nested, meta)
        # None: the dtype the run uses, read at its first forward (autocast's, else the model's own)
        self.limits = LowDtype.parse(dtype if dtype is not None else FLOAT16)
        self.dtype_name = self.limits.name
        self.dtype_source = "given" if dtype is not None else None
        self.log_path = Path(log) if log is not None else None
        self.builder = SummaryBuilder(self.dtype_name)
        self.step_index = 0
        self._handles: list[Any] = []
        self._names: dict[int, str] = {}  # id(module) -> qualified name
        self._param_names: dict[int, str] = {}
        self._arena = RowArena()  # this step's raw rows, filled in place by the kernels
        self._event_rows: list[tuple] = []  # arena handles, in execution order
        self._events: list[tuple[str, str, str]] = []  # (module, phase, tensor) of each row
        self._seen: dict[tuple[int, int], tuple[weakref.ref, Any]] = {}  # this step's measured tensors
        self._depth = 0  # module calls in flight (global mode: depth 0 is a root)
        self._param_rows: dict[str, tuple] = {}  # parameter name -> arena handle
        self._model_params: list[tuple[str, torch.nn.Parameter]] = []
        self._acc: torch.Tensor | None = None  # running Stats rows on the device (no log, one process)
        self._acc_index: dict[tuple, int] = {}
        self._last_norms: dict[str, float] = {}
        self._scaled_totals: dict[str, int] = {}
        self._optimizers: list[torch.optim.Optimizer] = [optimizer] if optimizer is not None else []
        self._in_scaler_step = False  # global mode: optimizer.step() called by a GradScaler
        self._log = None
        self._original_update = None
        self._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self._world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    # -- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Monitor:
        if self._handles:
            return self
        if self.log_path is not None and self._rank == 0:  # first: a log refused leaves no hook behind
            self._log = create_log(self.log_path, {"dtype": self.dtype_name, "every": self.every,
                                                   "world": self._world})  # closed in stop
        if self.model is not None:
            self._name_tree(self.model, "")
            self._model_params = list(self.model.named_parameters())  # walked once, not every step
            for module in self.model.modules():
                self._handles.append(module.register_forward_hook(self._forward_hook))
                if self.record_inputs:
                    self._handles.append(module.register_forward_pre_hook(self._input_hook))
        else:  # ampaudit run: every module that runs forward, whoever built it
            self._handles.append(module_hooks.register_module_forward_pre_hook(self._global_pre_hook))
            self._handles.append(module_hooks.register_module_forward_hook(self._global_forward_hook))
        if self.scaler is not None:
            self._wrap_scaler_update(self.scaler)
        elif self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._step_pre_hook))
            self._handles.append(self.optimizer.register_step_post_hook(self._step_post_hook))
        elif self.model is None:
            self._handles.append(optimizer_hooks.register_optimizer_step_pre_hook(self._global_step_hook))
            self._handles.append(optimizer_hooks.register_optimizer_step_post_hook(self._step_post_hook))
            self._patch_grad_scaler()
        return self

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._original_update is not None:
            target, original = self._original_update
            if isinstance(target, type):
                target.update, target.step = original
            elif target.__dict__.get("update") is original[0]:  # ours is on top: put back what it wrapped
                wrapped = original[1]
                while hasattr(wrapped, "ampaudit_wraps") and not wrapped.ampaudit_wraps[0]._handles:
                    wrapped = wrapped.ampaudit_wraps[1]  # a watch stopped out of order: drop its wrapper too
                if getattr(wrapped, "__func__", None) is type(target).update:
                    del target.update  # the class's own method again
                else:
                    target.update = wrapped  # an earlier watch's wrapper
            self._original_update = None
        if self._events:
            self._stopping = True  # recorded, never raised: the run is over (or already stopping)
            self._flush_step(skipped=False)  # a partial last step still counts
        if self._last_scaler is not None and self._last_scaler._scale is not None:
            # the scale the next step would use: records carry the one each step used
            self.builder.final_scale = float(self._last_scaler.get_scale())
            self._write({"final_scale": self.builder.final_scale})
        if self._log is not None:
            self._log.close()
            self._log = None

    # -- names --------------------------------------------------------------------------------
    def _name_tree(self, root: torch.nn.Module, prefix: str) -> None:
        """Qualified names relative to ``root`` ("blocks.2.proj"); the root itself is
        "(model)", or ``prefix`` for further roots (a loss module called on its own)."""
        for name, module in root.named_modules(remove_duplicate=False):
            label = f"{prefix}.{name}" if prefix and name else name or prefix or "(model)"
            self._names.setdefault(id(module), label)
        for name, param in root.named_parameters(remove_duplicate=False):
            self._param_names.setdefault(id(param), f"{prefix}.{name}" if prefix else name)

    def _global_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if self._depth == 0 and id(module) not in self._names:
            self._name_tree(module, "" if not self._names else type(module).__name__)
        self._depth += 1
        if self.record_inputs:
            self._input_hook(module, args)

    def _global_forward_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        self._forward_hook(module, args, output)

    # -- per-tensor recording -------------------------------------------------------------------
    @property
    def logging(self) -> bool:
        return self.step_index % self.every == 0

    def _record(self, module: str, phase: str, tensor: torch.Tensor, label: str) -> None:
        # Hot path: one raw row per tensor; everything else waits for the step boundary. A
        # container often returns its last child's very tensor: measured once, counted for both.
        key = (id(tensor), tensor._version)
        row = self._seen.get(key)
        if row is None or row[0]() is not tensor:  # a weak reference: never keeps activations alive
            handle, counts, extras = self._arena.take(tensor.device)
            stats.fill_row(tensor, counts, extras, self.limits)
            row = self._seen[key] = (weakref.ref(tensor), handle)
        self._event_rows.append(row[1])
        self._events.append((module, phase, label))

    def _input_hook(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() and not self.record_eval:
            return
        if self.dtype_source is None and torch.is_grad_enabled():
            self._detect_dtype(_tensors(args))
        if self.logging:
            name = self._names.get(id(module))
            for i, t in enumerate(_tensors(args, skipped=self.unmeasured)):
                if name is not None:
                    self._record(name, "input", t, f"input[{i}]")

    def _forward_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        name = self._names.get(id(module))
        phase = "forward"
        if not torch.is_grad_enabled():  # eval, generation: not training-step data
            self.eval_forwards += name == "(model)"  # the model's own calls
            if not self.record_eval:
                return
            phase = "eval"
        elif self.dtype_source is None:
            self._detect_dtype(_tensors(output))
        if not self.logging or name is None:
            return
        for i, t in enumerate(_tensors(output, skipped=self.unmeasured)):
            label = "output" if isinstance(output, torch.Tensor) else f"output[{i}]"
            self._record(name, phase, t, label)
            if t.requires_grad:
                t.register_hook(self._grad_hook(name, f"grad of {label}"))

    def _detect_dtype(self, outputs: list[torch.Tensor]) -> None:
        """At the first forward: autocast's dtype if autocast is on, else a low-precision
        output's (a ``.half()`` / ``.bfloat16()`` model), else float16."""
        devices = {t.device.type for t in outputs} or {"cuda" if torch.cuda.is_available() else "cpu"}
        for device in sorted(devices):
            if torch.is_autocast_enabled(device):
                dtype, source = torch.get_autocast_dtype(device), f"autocast ({device})"
                break
        else:
            low = [t.dtype for t in outputs if t.dtype in (torch.float16, torch.bfloat16)]
            dtype, source = (low[0], "the model's own dtype") if low else (torch.float16, "default")
        if dtype not in (torch.float16, torch.bfloat16):  # autocast to something else: audit for fp16
            dtype, source = torch.float16, f"default (autocast to {dtype})"
        self.limits = LowDtype.parse(dtype)
        self.dtype_name, self.dtype_source = self.limits.name, source
        self.builder.dtype = self.dtype_name

    def _grad_hook(self, name: str, label: str):
        def hook(grad: torch.Tensor) -> None:
            if self.logging and self._handles:
                self._record(name, "backward", grad, label)

        return hook

    # -- step boundaries --------------------------------------------------------------------------
    def _global_step_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._in_scaler_step:
            return  # a GradScaler drives this step: its update() is the boundary
        self._optimizers = [optimizer]
        self._step_pre_hook(optimizer, args, kwargs)

    def _step_pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The step boundary is before optimizer.step(), which reads this step's gradients -
        unless the step takes a closure (LBFGS, Lightning's automatic optimization): the
        closure runs this step's forward and backward inside step(), so the boundary is after."""
        # torch passes step()'s own args, the optimizer first: a closure is any callable after it
        if any(callable(a) for a in args if a is not optimizer) or callable(kwargs.get("closure")):
            self._closure_steps += 1
        else:
            self._boundary()

    def _step_post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._closure_steps:
            self._closure_steps -= 1
            self._boundary()

    def _wrap_scaler_update(self, scaler: torch.amp.GradScaler) -> None:
        """The scaler's update() becomes this watch's step boundary. Wrappers chain: a second
        watch on the same scaler wraps this one, and each one's stop() unwraps only its own."""
        original = scaler.update
        monitor = self

        def update(new_scale: Any = None) -> None:
            if monitor._handles:  # a watch stopped under a later one's wrapper passes through
                monitor._boundary(scaler=scaler)
            original(new_scale)

        update.ampaudit_wraps = (monitor, original)  # for unwrapping past stopped watches
        scaler.update = update  # instance attribute: unwrapped in stop()
        self._original_update = (scaler, (update, original))

    def _patch_grad_scaler(self) -> None:
        """ampaudit run: every GradScaler's update() becomes a step boundary (a skipped step
        included), and the optimizer it steps is the one whose gradients are recorded."""
        cls = torch.amp.GradScaler
        original_update, original_step = cls.update, cls.step
        monitor = self

        def step(self_scaler, optimizer, *args, **kwargs):
            monitor._optimizers = [optimizer]
            monitor._in_scaler_step = True
            try:
                return original_step(self_scaler, optimizer, *args, **kwargs)
            finally:
                monitor._in_scaler_step = False

        def update(self_scaler, new_scale=None):
            monitor._boundary(scaler=self_scaler)
            return original_update(self_scaler, new_scale)

        cls.update, cls.step = update, step
        self._original_update = (cls, (original_update, original_step))

    def step(self) -> None:
        """Mark a step boundary by hand (loops without an optimizer or scaler hook)."""
        self._boundary()

    def _boundary(self, scaler: torch.amp.GradScaler | None = None) -> None:
        found_inf = None
        scale = None
        if scaler is not None and scaler.is_enabled():
            self._last_scaler = scaler  # its scale after the last update() is read at stop()
            scale = scaler._scale
            flags = [v for state in scaler._per_optimizer_states.values()
                     for v in state.get("found_inf_per_device", {}).values()]
            found_inf = torch.stack([f.float().sum() for f in flags]).sum() if flags else None
        if self.logging:
            self._record_params(scale)
        self._flush_step(found_inf=found_inf, scale=scale)

    def _record_params(self, scale: torch.Tensor | None) -> None:
        if self.model is not None:
            params = [(n, p) for n, p in self._model_params if p.grad is not None]
        else:
            seen = [p for opt in self._optimizers for g in opt.param_groups for p in g["params"]]
            params = [(self._param_names.get(id(p), f"param{i}"), p) for i, p in enumerate(seen) if p.grad is not None]
        self._param_rows = {}
        for name, p in params:
            if unmeasurable(p.grad) is not None:  # a sparse embedding's gradient, say
                self.unmeasured[unmeasurable(p.grad)] += 1
                continue
            # The norm, and with a GradScaler how many gradients overflow at its current scale.
            handle, counts, extras = self._arena.take(p.grad.device)
            stats.fill_row(p.grad, counts, extras, self.limits, norm=True, scale=scale)
            self._param_rows[name] = handle

    def _flush_step(self, *, skipped: bool | None = None, found_inf: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None) -> None:
        step = self.step_index
        if self.logging:
            keys = sorted(set((module, phase) for module, phase, _ in self._events))
            param_keys = sorted(self._param_rows)
            flat = self._step_buffer(keys, param_keys, found_inf, scale)
            if self._log is None and self._world <= 1:
                # Nobody reads per-step numbers: keep the totals on the device and read back
                # only what this step must decide (first non-finite, skipped, scale).
                values = self._accumulate(flat, keys, param_keys)
                self._record_step(step, [], param_keys, values, skipped, totals_on_device=True)
            else:
                flat = self._reduce(flat, len(keys), len(param_keys))
                values = flat.tolist()  # the one host sync of this step
                self._record_step(step, keys, param_keys, values, skipped)
        self._event_rows, self._events, self._param_rows, self._seen = [], [], {}, {}
        self._arena.reset()
        self.step_index += 1

    def _accumulate(self, flat: torch.Tensor, keys: list, param_keys: list) -> list[float]:
        """Add this step's Stats rows to running totals on the device; return, read back,
        the per-parameter rows' finiteness and norms plus the step's tail (one small sync)."""
        width, n_params = stats.WIDTH, len(param_keys)
        all_keys = [("layer", *k) for k in keys] + [("param", k) for k in param_keys]
        rows = flat[: len(all_keys) * width].reshape(-1, width)
        for key in all_keys:
            if key not in self._acc_index:
                self._acc_index[key] = len(self._acc_index)
        grow = len(self._acc_index) - (0 if self._acc is None else self._acc.shape[0])
        if grow:
            pad = torch.zeros(grow, width, dtype=torch.float64, device=flat.device)
            self._acc = pad if self._acc is None else torch.cat([self._acc, pad])
        index = arena.index_tensor([self._acc_index[k] for k in all_keys], flat.device)
        absmax = stats.FIELDS.index("absmax")
        if len(all_keys):
            peak = self._acc[:, absmax].clone().scatter_reduce_(0, index, rows[:, absmax], "amax")
            self._acc.index_add_(0, index, rows)
            self._acc[:, absmax] = peak
        params = rows[len(keys):]
        tail = flat[len(all_keys) * width:]  # norms, overflow at scale, first, scale, found_inf
        small = torch.cat([params[:, stats.FIELDS.index("nan")] + params[:, stats.FIELDS.index("inf")], tail])
        values = small.tolist()  # the one host sync of this step
        self._last_norms = dict(zip(param_keys, values[n_params: 2 * n_params], strict=True))
        for name, count in zip(param_keys, values[2 * n_params: 3 * n_params], strict=True):
            if count >= 0:  # with a GradScaler: gradients overflowing at its current scale
                self._scaled_totals[name] = self._scaled_totals.get(name, 0) + int(count)
        return values

    def _step_buffer(self, keys: list, param_keys: list, found_inf: torch.Tensor | None,
                     scale: torch.Tensor | None) -> torch.Tensor:
        """Everything this step recorded, reduced on the device into one flat float64 buffer:
        Stats rows per (module, phase), per parameter, norms, overflow at scale, then the first
        non-finite event, the scale and the found-inf flag."""
        f64 = {"dtype": torch.float64}
        handles = self._event_rows + [self._param_rows[k] for k in param_keys]
        device = handles[0][0] if handles else torch.device("cpu")
        counts, extras = self._arena.matrix(handles, device)
        raw = stats.raw_matrix(counts, extras)
        events, n_events = raw[: len(self._event_rows)], len(self._event_rows)
        parts = []
        if n_events:
            slot = {key: i for i, key in enumerate(keys)}
            index = arena.index_tensor([slot[(m, p)] for m, p, _ in self._events], device)
            summed = torch.zeros(len(keys), stats.RAW, device=device, **f64).index_add_(0, index, events)
            absmax = LAYOUT.raw_extra["absmax"]
            summed[:, absmax] = torch.zeros(len(keys), device=device, **f64).scatter_reduce_(
                0, index, events[:, absmax], "amax", include_self=False)
            parts.append(stats.compact(summed, self.limits).reshape(-1))
            bad = stats.nonfinite(events)
            first = torch.where(bad.any(), bad.to(torch.int64).argmax(), NO_EVENT).to(**f64).reshape(1)
        else:
            first = torch.full((1,), float(NO_EVENT), device=device, **f64)
        if param_keys:
            parts.append(stats.compact(raw[n_events:], self.limits).reshape(-1))
            parts.append(extras[n_events:, LAYOUT.extra["sumsq"]].to(**f64).sqrt())
            parts.append(counts[n_events:, LAYOUT.count["scaled"]].to(**f64) if scale is not None
                         else torch.full((len(param_keys),), -1.0, device=device, **f64))
        minus_one = torch.full((1,), -1.0, device=device, **f64)
        tail = [first, scale.to(device, **f64).reshape(1) if scale is not None else minus_one,
                found_inf.to(device, **f64).reshape(1) if found_inf is not None else minus_one]
        return torch.cat([*parts, *tail])

    def _reduce(self, flat: torch.Tensor, n_rows: int, n_params: int) -> torch.Tensor:
        """Under torch.distributed: one all_gather of the buffer; counts summed, maxima kept,
        and the first non-finite taken from the earliest rank - kept on the device as
        sequence * world + rank, so that the step still reads back once."""
        if self._world <= 1:
            return flat
        gathered = [torch.empty_like(flat) for _ in range(self._world)]
        dist.all_gather(gathered, flat)
        stacked = torch.stack(gathered)
        out = stacked.sum(0)
        rows = n_rows + n_params
        peaks = torch.arange(rows, device=flat.device) * stats.WIDTH + stats.FIELDS.index("absmax")
        out[peaks] = stacked[:, peaks].max(0).values
        norms = rows * stats.WIDTH
        out[norms:norms + n_params] = stacked[:, norms:norms + n_params].max(0).values  # grads are all-reduced
        ranks = torch.arange(self._world, device=flat.device, dtype=flat.dtype)
        out[-3] = (stacked[:, -3] * self._world + ranks).min()
        out[-2], out[-1] = stacked[0, -2], stacked[:, -1].max()
        return out

    def _record_step(self, step: int, keys: list, param_keys: list, values: list[float],
                     skipped: bool | None, totals_on_device: bool = False) -> None:
        width = stats.WIDTH
        layers: dict[str, dict] = {}
        params, nonfinite_params = {}, []
        if totals_on_device:  # values: per-parameter nan+inf, norms, overflow at scale, tail
            nonfinite_params = [name for name, bad in zip(param_keys, values, strict=False) if bad]
        else:
            for i, (module, phase) in enumerate(keys):
                layers.setdefault(module, {})[phase] = stats.to_stats(values[i * width:(i + 1) * width])
            base, n = len(keys) * width, len(param_keys)
            norms, scaled = base + n * width, base + n * width + n
            for i, name in enumerate(param_keys):
                entry = stats.to_stats(values[base + i * width: base + (i + 1) * width])
                entry["norm"] = values[norms + i]
                if values[scaled + i] >= 0:
                    entry["overflow_at_scale"] = int(values[scaled + i])
                if entry["nan"] or entry["inf"]:
                    nonfinite_params.append(name)
                params[name] = entry
        first_seq, scale, found_inf = values[-3], values[-2], values[-1]
        rank = 0
        if self._world > 1:  # _reduce packed it as sequence * world + rank
            first_seq, rank = divmod(int(first_seq), self._world)
        first = None
        if first_seq < NO_EVENT and int(first_seq) < len(self._events):
            module, phase, tensor = self._events[int(first_seq)]
            first = {"step": step, "module": module, "phase": phase, "tensor": tensor}
            if self._world > 1:
                first["rank"] = rank
        elif nonfinite_params:
            first = {"step": step, "module": nonfinite_params[0], "phase": "backward", "tensor": "param grad"}
        was_skipped = bool(found_inf > 0) if found_inf >= 0 else bool(skipped)
        record = {"step": step, "steps_seen": step + 1, "layers": layers, "params": params,
                  "scale": scale if scale >= 0 else None, "skipped": was_skipped,
                  "first_nonfinite": first, "nonfinite_params": nonfinite_params if was_skipped else [],
                  "unmeasured": dict(self.unmeasured),  # so far: the builder keeps the latest
                  "dtype": self.dtype_name, "dtype_source": self.dtype_source,
                  "eval_forwards": self.eval_forwards}
        self.builder.add(record)
        self._write(record)
        self._skips_in_row = self._skips_in_row + 1 if was_skipped else 0
        if self.stop_on_nonfinite and not self._stopping:
            reason = stop_reason(record, self._skips_in_row, self.stop_after_skips)
            if reason is not None:
                raise NonFiniteError(reason)

    def _write(self, record: dict[str, Any]) -> None:
        if self._log is not None:
            self._log.write(json.dumps(record) + "\n")
            self._log.flush()  # a crash leaves every finished step readable

    # -- results ----------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        result = self.builder.summary()
        result["steps"] = max(result["steps"], self.step_index)
        if self._acc is not None:  # totals kept on the device: read them back once, now
            rows = self._acc.tolist()
            for key, i in self._acc_index.items():
                entry = stats.to_stats(rows[i])
                if key[0] == "layer":
                    result["layers"].setdefault(key[1], {})[key[2]] = entry
                else:
                    entry["norm"] = self._last_norms.get(key[1])
                    if key[1] in self._scaled_totals:
                        entry["overflow_at_scale"] = self._scaled_totals[key[1]]
                    result["params"][key[1]] = entry
            result["layers"] = dict(sorted(result["layers"].items()))
            result["params"] = dict(sorted(result["params"].items()))
        result["unmeasured"] = dict(sorted(self.unmeasured.items()))
        result["dtype_source"] = self.dtype_source or "default: no forward seen"
        result["eval_forwards"] = {"count": self.eval_forwards, "recorded": self.record_eval}
        return result

    def print(self, file: Any = None) -> None:
        from ampaudit.core.console import make_console
        from ampaudit.watch.render import render_summary

        render_summary(self.summary(), make_console(file or sys.stdout))


def watch(model: torch.nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
          scaler: torch.amp.GradScaler | None = None, log: str | Path | None = None, every: int = 1,
          dtype: LowDtype | torch.dtype | str | None = None, stop_on_nonfinite: bool = False,
          inputs: bool = False, stop_after_skips: int = 10, eval: bool = False) -> Monitor:
    """Watch ``model`` while it trains: ``with ampaudit.watch(model, optimizer=opt) as mon: ...``."""
    return Monitor(model, optimizer=optimizer, scaler=scaler, log=log, every=every, dtype=dtype,
                   stop_on_nonfinite=stop_on_nonfinite, inputs=inputs, stop_after_skips=stop_after_skips,
                   eval=eval)
