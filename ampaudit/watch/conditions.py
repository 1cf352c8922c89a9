"""The AMP6xx condition rows kept on the device, for a Monitor that writes no log.

Without a log, per-step layer and parameter statistics never leave the device (the Monitor
adds them to running totals there), so the per-step conditions the verdicts need
(``watch/verdicts.py``) are tracked there too: each logged step gathers the rows of the keys
it saw, updates them with a few tensor ops - the same arithmetic as ``verdicts.update_row``
on the host - and writes them back. Nothing is read until ``read()`` at ``summary()``: no
host sync per step, and memory stays constant (one row per key).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ampaudit.core.dtypes import LowDtype
from ampaudit.watch import arena, stats
from ampaudit.watch.stats_merge import FIELDS
from ampaudit.watch.verdicts import (
    BEST_LAST,
    BEST_LEN,
    BEST_START,
    COLUMNS,
    COUNT,
    FIRST,
    GRADIENTS,
    HEADROOM,
    LAST,
    NONFINITE,
    PEAK,
    RUN_LEN,
    RUN_START,
    SEEN,
    SUM_A,
    SUM_B,
    UNDERFLOW,
    UNSET,
    Key,
    Thresholds,
    owner,
)

_NUMEL, _NAN, _INF, _ZERO, _ABSMAX = (FIELDS.index(f) for f in ("numel", "nan", "inf", "zero", "absmax"))


def update_rows(rows: torch.Tensor, step: int, prev: int, cond: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor) -> torch.Tensor:
    """``verdicts.update_row`` for N keys at once: ``rows`` N x len(COLUMNS) float64, ``cond``
    N bools, ``a`` and ``b`` N float64. Returns the updated rows."""
    col = rows.unbind(1)
    extend = cond & (col[RUN_LEN] > 0) & (col[LAST] == prev)
    run_len = torch.where(cond, torch.where(extend, col[RUN_LEN] + 1, 1.0), col[RUN_LEN])
    run_start = torch.where(cond & ~extend, float(step), col[RUN_START])
    better = cond & (run_len > col[BEST_LEN])
    zero = torch.zeros_like(a)
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
        SUM_A: col[SUM_A] + torch.where(cond, a, zero),
        SUM_B: col[SUM_B] + torch.where(cond, b, zero),
        PEAK: torch.where(cond, torch.maximum(col[PEAK], a), col[PEAK]),
    }
    return torch.stack([new[i] for i in range(len(COLUMNS))], dim=1)


class _Layout:
    """Where one step's keys sit, computed once per distinct (keys, param_keys): which
    Stats rows feed which condition, and the state row of each."""

    def __init__(self, state: DeviceConditions, keys: tuple, param_keys: tuple, scaled: bool,
                 device: torch.device) -> None:
        nonfinite, allowed, headroom, index = [], [], [], []
        for i, (module, phase) in enumerate(keys):
            if phase in ("forward", "backward"):
                nonfinite.append(i)
                allowed.append(phase == "forward" or not scaled)
                index.append(state.slot((NONFINITE, module, phase)))
        for i, (module, phase) in enumerate(keys):
            if phase == "forward":
                headroom.append(i)
                index.append(state.slot((HEADROOM, module, phase)))
        modules: dict[str, int] = {}
        group = []
        for name in param_keys:
            module = owner(name)
            group.append(modules.setdefault(module, len(modules)))
            state.params.setdefault(module, set()).add(name)
        index += [state.slot((UNDERFLOW, module, GRADIENTS)) for module in modules]
        self.nonfinite = arena.index_tensor(nonfinite, device)
        self.allowed = arena.index_tensor([int(x) for x in allowed], device).bool()
        self.headroom = arena.index_tensor(headroom, device)
        self.group = arena.index_tensor(group, device)
        self.modules = len(modules)
        self.index = arena.index_tensor(index, device)


class DeviceConditions:
    """Condition rows on the device, keyed like ``Verdicts.rows``."""

    def __init__(self) -> None:
        self.thresholds = Thresholds.load()
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
        rows of ``keys`` ((module, phase)) and then of ``param_keys`` (``Monitor._step_buffer``);
        ``scale``: the loss scale the step used (a device scalar), or None without a GradScaler."""
        n_layers, width = len(keys), stats.WIDTH
        if not n_layers and not param_keys:
            return
        device = flat.device
        stat = flat[: (n_layers + len(param_keys)) * width].reshape(-1, width)
        layers, params = stat[:n_layers], stat[n_layers:]
        cache = (tuple(keys), tuple(param_keys), scale is None, device)
        layout = self._layouts.get(cache)
        if layout is None:
            if len(self._layouts) >= 64:
                del self._layouts[next(iter(self._layouts))]
            layout = self._layouts[cache] = _Layout(self, *cache[:2], scale is not None, device)
        self._grow(device)
        t = self.thresholds
        # AMP605: NaN or Inf; AMP602: the absmax near the dtype's max
        nf = layers.index_select(0, layout.nonfinite)
        nf_bad = nf[:, _NAN] + nf[:, _INF]
        hr = layers.index_select(0, layout.headroom)
        hr_peak = hr[:, _ABSMAX]
        # AMP601: gradients below the smallest normal at the step's scale, with the zeros beside them
        bounds = self._bounds.get(device)
        if bounds is None:  # 2^(e+1): the top of each exponent bin; the Inf/NaN bin never counts
            top = [math.ldexp(1.0, e - 127 + 1) for e in range(255)] + [math.inf]
            bounds = torch.tensor(top, dtype=torch.float64)
            if device.type == "cuda":  # from pinned memory, without waiting: no host sync
                bounds = bounds.pin_memory().to(device, non_blocking=True)
            else:
                bounds = bounds.to(device)
            self._bounds[device] = bounds
        at_scale = bounds if scale is None else bounds * scale.to(device, torch.float64).reshape(())
        under = (params[:, stats.HIST:] * (at_scale <= limits.normal)).sum(1)
        zero, nonzero = params[:, _ZERO], params[:, stats.HIST: stats.HIST + 255].sum(1)
        finite = (params[:, _NAN] + params[:, _INF]) == 0  # a tensor that overflowed says nothing of underflow
        none = torch.zeros_like(zero)
        lost = torch.where(finite, under + torch.where((nonzero == 0) | (under >= t.zero_share * nonzero), zero, none),
                           none)
        numel = torch.where(finite, params[:, _NUMEL], none)
        lost_m = torch.zeros(layout.modules, dtype=torch.float64, device=device).index_add_(0, layout.group, lost)
        numel_m = torch.zeros(layout.modules, dtype=torch.float64, device=device).index_add_(0, layout.group, numel)
        cond = torch.cat([(nf_bad > 0) & layout.allowed, hr_peak >= limits.max / t.factor,
                          (numel_m > 0) & (lost_m >= t.min_share * numel_m)])
        a = torch.cat([nf_bad, hr_peak, lost_m])
        b = torch.cat([nf[:, _NUMEL], hr[:, _NUMEL], numel_m])
        rows = self._rows.index_select(0, layout.index)
        self._rows.index_copy_(0, layout.index, update_rows(rows, step, self._prev, cond, a, b))
        self._prev = step

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
