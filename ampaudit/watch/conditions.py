"""The AMP6xx condition rows kept on the device, for a Monitor that writes no log.

Without a log, per-step layer and parameter statistics never leave the device (the Monitor
adds them to running totals there), so each ``ModuleRule``'s condition (``runtime_rules.py``)
runs there too, over a ``DeviceView`` whose columns are tensors with one element per module.
Each logged step gathers the rows of the keys it saw, updates them with a few tensor ops -
the same arithmetic as ``verdicts.update_row`` on the host - and writes them back. Nothing
is read until ``read()`` at ``summary()``: no host sync per step, and memory stays constant
(one row per key).

The conditions of up to ``BATCH`` logged steps with the same keys are judged together: each
rule's few dozen tensor ops run once over all their rows, which on a small model costs as much
as one step's (the per-op cost dominates, not the rows); the state rows are then updated step
by step, in order (``update_rows``: one C loop on the CPU). ``read()`` judges what is pending.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ampaudit.core.dtypes import LowDtype
from ampaudit.watch import arena, cpu_kernel, stats
from ampaudit.watch.rule_api import (
    BEST_LAST,
    BEST_LEN,
    BEST_START,
    COLUMNS,
    COUNT,
    FIRST,
    GRADIENTS,
    LAST,
    PEAK,
    RUN_LEN,
    RUN_START,
    SEEN,
    SUM_TOTAL,
    SUM_VALUE,
    UNSET,
    LayerRule,
    ModuleRule,
    StatsView,
    Step,
    Value,
    owner,
    rule_units,
)
from ampaudit.watch.stats_merge import FIELDS
from ampaudit.watch.verdicts import Key

_FIELD = {name: i for i, name in enumerate(FIELDS)}
_EXPONENTS = 255  # the histogram's magnitudes: exponent 255 (Inf/NaN) is none
BATCH = 16  # logged steps judged together (their Stats rows kept until then: ~0.2 MB a step on nanoGPT)


def update_rows(rows: torch.Tensor, step: int, prev: int, cond: torch.Tensor, value: torch.Tensor,
                total: torch.Tensor) -> torch.Tensor:
    """``verdicts.update_row`` for N keys at once: ``rows`` N x len(COLUMNS) float64, ``cond``
    N bools, ``value`` and ``total`` N float64. Returns the updated rows."""
    col = rows.unbind(1)
    extend = cond & (col[RUN_LEN] > 0) & (col[LAST] == prev)
    run_len = torch.where(cond, torch.where(extend, col[RUN_LEN] + 1, 1.0), col[RUN_LEN])
    run_start = torch.where(cond & ~extend, float(step), col[RUN_START])
    better = cond & (run_len > col[BEST_LEN])
    zero = torch.zeros_like(value)
    new = {
        FIRST: torch.where(cond & (col[FIRST] < 0), float(step), col[FIRST]),
        LAST: torch.where(cond, float(step), col[LAST]),
        RUN_START: run_start,
        BEST_START: torch.where(better, run_start, col[BEST_START]),
        BEST_LAST: torch.where(better, float(step), col[BEST_LAST]),
        COUNT: col[COUNT] + cond,
        SEEN: col[SEEN] + 1,
        RUN_LEN: run_len,
        BEST_LEN: torch.where(better, run_len, col[BEST_LEN]),
        SUM_VALUE: col[SUM_VALUE] + torch.where(cond, value, zero),
        SUM_TOTAL: col[SUM_TOTAL] + torch.where(cond, total, zero),
        PEAK: torch.where(cond, torch.maximum(col[PEAK], value), col[PEAK]),
    }
    return torch.stack([new[i] for i in range(len(COLUMNS))], dim=1)


def update_steps(rows: torch.Tensor, steps: list[int], prev: int, cond: torch.Tensor, value: torch.Tensor,
                 total: torch.Tensor) -> torch.Tensor:
    """``update_rows`` for K logged steps in order: ``cond``, ``value`` and ``total`` are K x N.
    On the CPU one C loop (``cpu_kernel.update_rows``, the same arithmetic), elsewhere K
    ``update_rows``."""
    if rows.device.type == "cpu" and cpu_kernel.available():
        return cpu_kernel.update_rows(rows, steps, prev, cond, value, total)
    for k, step in enumerate(steps):
        rows = update_rows(rows, step, prev, cond[k], value[k], total[k])
        prev = step
    return rows


class _Part:
    """One module rule's share of a step's layout: the Stats rows it reads (a LayerRule's
    phases), or each parameter's module (a GradientRule), and how many condition rows. Its
    indices over a batch of steps are made once per batch size."""

    def __init__(self, rows: list[int], phases: list[str], group: list[int], n: int, device: torch.device) -> None:
        self._rows, self._group = rows, group
        self.phases = tuple(phases)
        self.n = n
        self.device = device
        self._made: dict[tuple, torch.Tensor] = {}

    def _index(self, key: tuple, values: Callable[[], list[int]]) -> torch.Tensor:
        found = self._made.get(key)
        if found is None:
            found = self._made[key] = arena.index_tensor(values(), self.device)
        return found

    def rows(self, k: int, offset: int, stride: int) -> torch.Tensor:
        """Where its Stats rows are among ``k`` steps' rows, each step's ``stride`` rows after the
        last's, its own from ``offset`` on (its rows, or all ``stride - offset`` parameters)."""
        own = self._rows or range(stride - offset)
        return self._index(("rows", k, offset, stride),
                           lambda: [offset + r + i * stride for i in range(k) for r in own])

    def group(self, k: int) -> torch.Tensor:
        """Each parameter row's condition row, for ``k`` steps."""
        return self._index(("group", k), lambda: [g + i * self.n for i in range(k) for g in self._group])

    def mask(self, phase: str, k: int) -> torch.Tensor:
        return self._index(("mask", phase, k), lambda: [int(p == phase) for p in self.phases] * k).bool()


class _Layout:
    """Where one step's keys sit, computed once per distinct (keys, param_keys): which
    Stats rows feed which rule, and the state row of each condition."""

    def __init__(self, state: DeviceConditions, keys: tuple, param_keys: tuple, device: torch.device) -> None:
        modules: dict[str, int] = {}
        group = []
        for name in param_keys:
            module = owner(name)
            group.append(modules.setdefault(module, len(modules)))
            state.params.setdefault(module, set()).add(name)
        index: list[int] = []
        self.parts: list[_Part] = []
        for unit in state.units:
            if isinstance(unit, LayerRule):
                rows = [i for i, (_, phase) in enumerate(keys) if phase in unit.phases]
                index += [state.slot((unit.code, *keys[i])) for i in rows]
                part = _Part(rows, [keys[i][1] for i in rows], [], len(rows), device)
            else:
                index += [state.slot((unit.code, module, GRADIENTS)) for module in modules]
                part = _Part([], [GRADIENTS] * len(param_keys), group, len(modules), device)
            self.parts.append(part)
        self.index = arena.index_tensor(index, device)


class DeviceView(StatsView):
    """Rows ``index`` of ``k`` logged steps' Stats rows (``matrix``, M x ``stats.WIDTH``) as a
    condition reads them: a tensor column per field, gathered when read. A step's loss scale
    (``Step.scale``) is a column too, one element per row."""

    def __init__(self, matrix: torch.Tensor, index: torch.Tensor, part: _Part, bounds: torch.Tensor,
                 steps: int) -> None:
        self._matrix, self._index, self._part, self._bounds, self._steps = matrix, index, part, bounds, steps
        self._hist: torch.Tensor | None = None

    def field(self, name: str) -> Value:
        return self._matrix[:, _FIELD[name]].index_select(0, self._index)

    def _histogram(self) -> torch.Tensor:
        if self._hist is None:
            self._hist = self._matrix[:, stats.HIST:].index_select(0, self._index)
        return self._hist

    @property
    def nonzero(self) -> Value:
        return self._histogram()[:, :_EXPONENTS].sum(1)

    def below(self, limit: float, scale: Value | None) -> Value:
        bounds = self._bounds
        top = bounds if scale is None else bounds * scale.to(bounds.device, torch.float64).reshape(-1, 1)
        return (self._histogram() * (top <= limit)).sum(1)

    def in_phase(self, phase: str) -> Value:
        return self._part.mask(phase, self._steps)


def _column(x: Value, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A condition's result as n elements: a constant (a rule may return one) filled on the device."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype).expand(n)
    return torch.full((n,), x, dtype=dtype, device=device)


class _Pending:
    """Logged steps with the same keys, loss scale or none, and audited dtype, not judged yet:
    their Stats rows copied into one buffer, reused batch after batch (a fresh one each time
    would be megabytes of new pages to fault in)."""

    def __init__(self, layout: _Layout, n_layers: int, scaled: bool, limits: LowDtype, buffer: torch.Tensor) -> None:
        self.layout, self.n_layers, self.scaled, self.limits = layout, n_layers, scaled, limits
        self.buffer = buffer  # batch x rows per step x width
        self.steps: list[int] = []
        self.scales: list[torch.Tensor] = []
        self.skips: list[torch.Tensor] = []  # with a loss scale: whether the scaler skipped each step

    def fits(self, layout: _Layout, scaled: bool, limits: LowDtype) -> bool:
        return layout is self.layout and scaled == self.scaled and limits == self.limits

    def add(self, step: int, rows: torch.Tensor, scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        self.buffer[len(self.steps)].copy_(rows)
        self.steps.append(step)
        if scale is not None:  # the scaler's own tensor changes at its update(): this step's value
            self.scales.append(scale.detach().to(torch.float64).reshape(1).clone())
            self.skips.append(found_inf.detach().reshape(1) > 0 if found_inf is not None
                              else torch.zeros(1, dtype=torch.bool, device=scale.device))


class DeviceConditions:
    """Condition rows on the device, keyed like ``Verdicts.rows``."""

    def __init__(self, batch: int | None = None) -> None:
        self.units: list[ModuleRule] = [u for u in rule_units().values() if isinstance(u, ModuleRule)]
        self.keys: dict[Key, int] = {}
        self.params: dict[str, set[str]] = {}
        self.batch = batch or BATCH
        self._rows: torch.Tensor | None = None
        self._layouts: dict[tuple, _Layout] = {}
        self._bounds: dict[torch.device, torch.Tensor] = {}
        self._prev = -1
        self._pending: _Pending | None = None
        self._buffer: torch.Tensor | None = None  # the pending steps' rows (``_Pending``)

    def slot(self, key: Key) -> int:
        return self.keys.setdefault(key, len(self.keys))

    def add(self, step: int, flat: torch.Tensor, keys: list, param_keys: list, scale: torch.Tensor | None,
            limits: LowDtype, found_inf: torch.Tensor | None = None) -> None:
        """One logged step. ``flat``: the Monitor's step buffer, whose first rows are the Stats
        rows of ``keys`` ((module, phase)) and then of ``param_keys`` (``StepReducer.step_buffer``);
        ``scale``: the loss scale the step used (a device scalar), or None without a GradScaler.
        Judged with the next steps of the same keys, up to ``batch`` of them."""
        n_layers, width = len(keys), stats.WIDTH
        if not n_layers and not param_keys:
            return
        device = flat.device
        cache = (tuple(keys), tuple(param_keys), device)
        layout = self._layouts.get(cache)
        if layout is None:
            if len(self._layouts) >= 64:
                del self._layouts[next(iter(self._layouts))]
            layout = self._layouts[cache] = _Layout(self, *cache)
        pending = self._pending
        if pending is not None and not pending.fits(layout, scale is not None, limits):
            self.flush()
            pending = None
        rows = flat[: (n_layers + len(param_keys)) * width].reshape(-1, width)
        if pending is None:
            buffer = self._buffer
            if buffer is None or buffer.shape[1:] != rows.shape or buffer.device != device:
                buffer = self._buffer = torch.empty(self.batch, *rows.shape, dtype=torch.float64, device=device)
            pending = self._pending = _Pending(layout, n_layers, scale is not None, limits, buffer)
        pending.add(step, rows, scale, found_inf)
        if len(pending.steps) >= self.batch:
            self.flush()

    def flush(self) -> None:
        """Judge the pending steps: each rule over all their rows at once, then the state rows
        updated step by step."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        layout, n_layers, k = pending.layout, pending.n_layers, len(pending.steps)
        per_step = pending.buffer.shape[1]  # each step's layers, then its parameters
        stat = pending.buffer[:k].reshape(-1, stats.WIDTH)
        device = stat.device
        n_params = per_step - n_layers
        scales = torch.cat(pending.scales) if pending.scaled else None  # one per step
        skips = torch.cat(pending.skips).to(device) if pending.scaled else None
        self._grow(device)
        bounds = self._bin_tops(device)
        f64 = torch.float64

        def at(rows: int) -> Step:  # each step's loss scale for each of its ``rows`` rows
            if scales is None:
                return Step(pending.limits, None)
            return Step(pending.limits, scales.repeat_interleave(rows), skipped=skips.repeat_interleave(rows))

        holds, values, totals = [], [], []
        for unit, part in zip(self.units, layout.parts, strict=True):
            if not part.n:
                continue
            if isinstance(unit, LayerRule):
                cond, value, total = unit.condition(DeviceView(stat, part.rows(k, 0, per_step), part, bounds, k),
                                                    at(part.n))
            else:  # a GradientRule: each parameter measured, the sums judged per module
                view = DeviceView(stat, part.rows(k, n_layers, per_step), part, bounds, k)
                step = at(n_params)
                over_step = tuple(_column(x, k * n_params, f64, device).reshape(k, n_params).sum(1)
                                  .repeat_interleave(n_params) for x in unit.step_sums(view, step))
                value, total = unit.measure(view, replace(step, sums=over_step))
                group = part.group(k)
                sums = [torch.zeros(k * part.n, dtype=f64, device=device).index_add_(
                    0, group, _column(x, k * n_params, f64, device)) for x in (value, total)]
                value, total = sums
                cond = unit.condition(value, total, at(part.n))
            holds.append(_column(cond, k * part.n, torch.bool, device).reshape(k, part.n))
            values.append(_column(value, k * part.n, f64, device).reshape(k, part.n))
            totals.append(_column(total, k * part.n, f64, device).reshape(k, part.n))
        if holds:
            rows = self._rows.index_select(0, layout.index)
            self._rows.index_copy_(0, layout.index, update_steps(rows, pending.steps, self._prev, torch.cat(holds, 1),
                                                                 torch.cat(values, 1), torch.cat(totals, 1)))
        self._prev = pending.steps[-1]

    def _bin_tops(self, device: torch.device) -> torch.Tensor:
        """2^(e+1), the top of each exponent bin of the Stats histogram; the Inf/NaN bin never counts."""
        bounds = self._bounds.get(device)
        if bounds is None:
            top = [math.ldexp(1.0, e - 127 + 1) for e in range(_EXPONENTS)] + [math.inf]
            bounds = torch.tensor(top, dtype=torch.float64)
            if device.type == "cuda":  # from pinned memory, without waiting: no host sync
                bounds = bounds.pin_memory().to(device, non_blocking=True)
            else:
                bounds = bounds.to(device)
            self._bounds[device] = bounds
        return bounds

    def _grow(self, device: torch.device) -> None:
        have = 0 if self._rows is None else self._rows.shape[0]
        if len(self.keys) > have:
            pad = torch.zeros(len(self.keys) - have, len(COLUMNS), dtype=torch.float64, device=device)
            pad[:, :UNSET] = -1.0
            self._rows = pad if self._rows is None else torch.cat([self._rows.to(device), pad])

    def read(self) -> dict[str, Any] | None:
        """The rows, read back once, as ``Verdicts.findings`` takes them; None before any step."""
        self.flush()
        if self._rows is None:
            return None
        values = self._rows.tolist()
        return {"rows": {key: values[i] for key, i in self.keys.items()},
                "params": {m: set(names) for m, names in self.params.items()}}
