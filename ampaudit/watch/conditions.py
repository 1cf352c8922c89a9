"""The AMP6xx condition rows kept on the device, for a Monitor that writes no log.

Without a log, per-step layer and parameter statistics never leave the device (the Monitor
adds them to running totals there), so each ``ModuleRule``'s condition (``runtime_rules.py``)
runs there too, over a ``DeviceView`` whose columns are tensors with one element per module.
Each logged step gathers the rows of the keys it saw, updates them with a few tensor ops -
the same arithmetic as ``verdicts.update_row`` on the host - and writes them back. Nothing
is read until ``read()`` at ``summary()``: no host sync per step, and memory stays constant
(one row per key).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ampaudit.core.dtypes import LowDtype
from ampaudit.watch import arena, stats
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


class _Part:
    """One module rule's share of a step's layout: the Stats rows it reads (a LayerRule's
    phases), or each parameter's module (a GradientRule), and how many condition rows."""

    def __init__(self, rows: list[int], phases: list[str], group: list[int], n: int, device: torch.device) -> None:
        self.rows = arena.index_tensor(rows, device)
        self.phases = tuple(phases)
        self.group = arena.index_tensor(group, device)
        self.n = n
        self.device = device
        self._masks: dict[str, torch.Tensor] = {}

    def mask(self, phase: str) -> torch.Tensor:
        found = self._masks.get(phase)
        if found is None:
            found = self._masks[phase] = arena.index_tensor([int(p == phase) for p in self.phases], self.device).bool()
        return found


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
    """A step's Stats rows (N x ``stats.WIDTH``) as a condition reads them: a tensor column per field."""

    def __init__(self, rows: torch.Tensor, part: _Part, bounds: torch.Tensor) -> None:
        self._rows, self._part, self._bounds = rows, part, bounds

    def field(self, name: str) -> Value:
        return self._rows[:, _FIELD[name]]

    @property
    def nonzero(self) -> Value:
        return self._rows[:, stats.HIST: stats.HIST + _EXPONENTS].sum(1)

    def below(self, limit: float, scale: Value | None) -> Value:
        top = self._bounds if scale is None else self._bounds * scale.to(self._bounds.device, torch.float64).reshape(())
        return (self._rows[:, stats.HIST:] * (top <= limit)).sum(1)

    def in_phase(self, phase: str) -> Value:
        return self._part.mask(phase)


def _column(x: Value, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A condition's result as n elements: a constant (a rule may return one) filled on the device."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype).expand(n)
    return torch.full((n,), x, dtype=dtype, device=device)


class DeviceConditions:
    """Condition rows on the device, keyed like ``Verdicts.rows``."""

    def __init__(self) -> None:
        self.units: list[ModuleRule] = [u for u in rule_units().values() if isinstance(u, ModuleRule)]
        self.keys: dict[Key, int] = {}
        self.params: dict[str, set[str]] = {}
        self._rows: torch.Tensor | None = None
        self._layouts: dict[tuple, _Layout] = {}
        self._bounds: dict[torch.device, torch.Tensor] = {}
        self._prev = -1

    def slot(self, key: Key) -> int:
        return self.keys.setdefault(key, len(self.keys))

    def add(self, step: int, flat: torch.Tensor, keys: list, param_keys: list, scale: torch.Tensor | None,
            limits: LowDtype) -> None:
        """One logged step. ``flat``: the Monitor's step buffer, whose first rows are the Stats
        rows of ``keys`` ((module, phase)) and then of ``param_keys`` (``StepReducer.step_buffer``);
        ``scale``: the loss scale the step used (a device scalar), or None without a GradScaler."""
        n_layers, width = len(keys), stats.WIDTH
        if not n_layers and not param_keys:
            return
        device = flat.device
        stat = flat[: (n_layers + len(param_keys)) * width].reshape(-1, width)
        layers, params = stat[:n_layers], stat[n_layers:]
        cache = (tuple(keys), tuple(param_keys), device)
        layout = self._layouts.get(cache)
        if layout is None:
            if len(self._layouts) >= 64:
                del self._layouts[next(iter(self._layouts))]
            layout = self._layouts[cache] = _Layout(self, *cache)
        self._grow(device)
        bounds = self._bin_tops(device)
        at = Step(limits, scale)
        f64 = torch.float64
        holds, values, totals = [], [], []
        for unit, part in zip(self.units, layout.parts, strict=True):
            if not part.n:
                continue
            if isinstance(unit, LayerRule):
                cond, value, total = unit.condition(DeviceView(layers.index_select(0, part.rows), part, bounds), at)
            else:  # a GradientRule: each parameter measured, the sums judged per module
                value, total = unit.measure(DeviceView(params, part, bounds), at)
                sums = [torch.zeros(part.n, dtype=f64, device=device).index_add_(
                    0, part.group, _column(x, len(param_keys), f64, device)) for x in (value, total)]
                value, total = sums
                cond = unit.condition(value, total, at)
            holds.append(_column(cond, part.n, torch.bool, device))
            values.append(_column(value, part.n, f64, device))
            totals.append(_column(total, part.n, f64, device))
        if holds:
            rows = self._rows.index_select(0, layout.index)
            self._rows.index_copy_(0, layout.index, update_rows(rows, step, self._prev, torch.cat(holds),
                                                                torch.cat(values), torch.cat(totals)))
        self._prev = step

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
        if self._rows is None:
            return None
        values = self._rows.tolist()
        return {"rows": {key: values[i] for key, i in self.keys.items()},
                "params": {m: set(names) for m, names in self.params.items()}}
