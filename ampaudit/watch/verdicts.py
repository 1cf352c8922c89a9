"""Verdicts, not only counts: the AMP6xx findings of a watched run, by the rules of
``runtime_rules.py``, on the host.

Torch-free: ``ampaudit report`` builds them from a log as it streams, and a Monitor from the
records it makes; both go through ``SummaryBuilder`` (``watch/summary.py``), so a run gives
the same findings live and from its log. Each logged step runs every ``ModuleRule``'s
condition over the record's Stats (``HostView``: Python numbers) and feeds each ``StepRule``
the loss scale and skip. Memory stays constant however long the run: one ``Row`` per (rule,
module, phase), and each step rule's own state. A Monitor without a log runs the same
conditions on the device (``conditions.py``) and hands its rows over at ``summary()``.
"""

from __future__ import annotations

import math
import os
import sys
from collections import Counter
from dataclasses import replace
from typing import Any

from ampaudit.core.dtypes import LowDtype
from ampaudit.core.findings import Finding
from ampaudit.core.rulebook import rule
from ampaudit.watch.rule_api import (
    BEST_LAST,
    BEST_LEN,
    BEST_START,
    COLUMNS,
    COUNT,
    FIRST,
    FIRSTS_KEPT,
    GRADIENTS,
    LAST,
    PEAK,
    REGISTRY,
    RUN_LEN,
    RUN_START,
    SEEN,
    SUM_TOTAL,
    SUM_VALUE,
    UNSET,
    Fp8Rows,
    Fp8Rule,
    GradientRule,
    LayerRule,
    ModuleRule,
    Row,
    Run,
    RuntimeRule,
    ScaleStep,
    StatsView,
    Step,
    StepRule,
    Value,
    owner,
    rule_units,
)

RUNTIME_RULES: tuple[str, ...] = tuple(sorted(REGISTRY.load()))  # the AMP6xx and AMP75x codes, one unit each

Key = tuple[str, str, str]  # (rule, module, phase)


def new_row() -> list[float]:
    return [-1.0] * UNSET + [0.0] * (len(COLUMNS) - UNSET)


def update_row(row: list[float], step: int, prev: int, cond: bool, value: float, total: float) -> None:
    """One logged step of a key that had a row in it; ``prev`` is the logged step before.
    The same arithmetic as ``conditions.update_rows`` on the device."""
    row[SEEN] += 1
    if not cond:
        return
    extend = row[RUN_LEN] > 0 and row[LAST] == prev
    if not extend:
        row[RUN_START] = step
    row[RUN_LEN] = row[RUN_LEN] + 1 if extend else 1
    if row[FIRST] < 0:
        row[FIRST] = step
    row[LAST] = step
    row[COUNT] += 1
    if row[RUN_LEN] > row[BEST_LEN]:
        row[BEST_START], row[BEST_LAST], row[BEST_LEN] = row[RUN_START], step, row[RUN_LEN]
    row[SUM_VALUE] += value
    row[SUM_TOTAL] += total
    row[PEAK] = max(row[PEAK], value)


def last_bin_below(scale: float, limit: float) -> int:
    """The highest exponent e whose bin [2^e, 2^(e+1)), multiplied by ``scale``, lies wholly
    below ``limit``: 2^(e+1) * scale <= limit (exact: a product with a power of two, as on
    the device)."""
    if not 0 < scale < math.inf:  # 0: every bin; inf or NaN: none (as the device's comparison)
        return 10**6 if scale == 0 else -(10**6)
    e = math.floor(math.log2(limit) - math.log2(scale)) - 1
    while math.ldexp(scale, e + 2) <= limit:
        e += 1
    while math.ldexp(scale, e + 1) > limit:
        e -= 1
    return e


class HostView(StatsView):
    """One tensor's Stats from a log record, as a condition reads them: Python numbers."""

    def __init__(self, stats: dict[str, Any], phase: str, below: dict[tuple[float, Any], int]) -> None:
        self._stats, self._phase = stats, phase
        self._below = below  # last_bin_below per (limit, scale), shared by a record's views

    def field(self, name: str) -> Value:
        return self._stats.get(name, 0)

    @property
    def nonzero(self) -> Value:
        return sum(c for _, c in self._stats["hist"])

    def below(self, limit: float, scale: Value | None) -> Value:
        last = self._below.get((limit, scale))
        if last is None:
            last = self._below[(limit, scale)] = last_bin_below(1.0 if scale is None else scale, limit)
        under = 0
        for e, c in self._stats["hist"]:  # in ascending order of e
            if e > last:
                break
            under += c
        return under

    def in_phase(self, phase: str) -> Value:
        return self._phase == phase


def record_entries(record: dict[str, Any], limits: LowDtype, units: list[ModuleRule]
                   ) -> tuple[list[tuple[Key, bool, float, float]], dict[str, list[str]]]:
    """A log record's conditions: (key, holds, value, total) per key, and each module's parameters."""
    step = Step(limits, record.get("scale"), skipped=bool(record.get("skipped")))
    below: dict[tuple[float, Any], int] = {}
    entries: list[tuple[Key, bool, float, float]] = []
    for unit in units:
        if isinstance(unit, LayerRule):
            for module, phases in record["layers"].items():
                for phase in unit.phases:
                    s = phases.get(phase)
                    if s is not None:
                        holds, value, total = unit.condition(HostView(s, phase, below), step)
                        entries.append(((unit.code, module, phase), bool(holds), float(value), float(total)))
        elif isinstance(unit, GradientRule):
            views = {name: HostView(s, GRADIENTS, below) for name, s in record["params"].items()}
            at = step
            if views:
                parts = [unit.step_sums(view, step) for view in views.values()]
                at = replace(step, sums=tuple(sum(column) for column in zip(*parts, strict=True)))
            sums: dict[str, list[float]] = {}
            for name, view in views.items():
                value, total = unit.measure(view, at)
                acc = sums.setdefault(owner(name), [0.0, 0.0])
                acc[0] += value
                acc[1] += total
            for module, (value, total) in sums.items():
                entries.append(((unit.code, module, GRADIENTS), bool(unit.condition(value, total, step)), value, total))
    params: dict[str, list[str]] = {}
    for name in record["params"]:
        params.setdefault(owner(name), []).append(name)
    return entries, params


class Verdicts:
    """The state the AMP6xx rules need, fed one record (logged step) at a time."""

    def __init__(self) -> None:
        self.units: dict[str, RuntimeRule] = rule_units()
        self._module_units = [u for u in self.units.values() if isinstance(u, ModuleRule)]
        self._step_units = [u for u in self.units.values() if isinstance(u, StepRule)]
        self._fp8_units = [u for u in self.units.values() if isinstance(u, Fp8Rule)]
        self.rows: dict[Key, list[float]] = {}
        self.params: dict[str, set[str]] = {}  # module -> its parameters seen with gradients
        self._prev = -1  # the logged step before
        # the loss scale, for every step rule
        self.scaled_steps = 0
        self.first_scaled: int | None = None
        self.peak: tuple[float, int] | None = None  # the highest scale a step was applied with, its step
        self.nonfinite: Counter = Counter()  # parameters non-finite on skipped steps
        self.skipped = 0  # logged steps the GradScaler skipped
        self.firsts: list[tuple[int, str | None, str | None]] = []  # Run.firsts

    def add(self, record: dict[str, Any], dtype: str) -> None:
        step = record["step"]
        limits = LowDtype.parse(record.get("dtype") or dtype)
        entries, params = record_entries(record, limits, self._module_units)
        for key, cond, value, total in entries:
            row = self.rows.get(key)
            if row is None:
                row = self.rows[key] = new_row()
            update_row(row, step, self._prev, cond, value, total)
        for module, names in params.items():
            self.params.setdefault(module, set()).update(names)
        self._add_scale(step, record.get("scale"), bool(record.get("skipped")), record.get("nonfinite_params") or [])
        self._add_first(step, record.get("first_nonfinite"))
        if isinstance(record.get("fp8"), dict):  # watch(..., fp8=True)
            rows = Fp8Rows(step, self._prev, record["fp8"])
            for unit in self._fp8_units:
                unit.observe(rows)
        self._prev = step

    def _add_first(self, step: int, first: Any) -> None:
        """This step's first non-finite, kept where it changes (``Run.firsts``)."""
        seen = (first.get("module"), first.get("phase")) if isinstance(first, dict) else (None, None)
        last = self.firsts[-1][1:] if self.firsts else (None, None)
        if seen != last and len(self.firsts) < FIRSTS_KEPT:
            self.firsts.append((step, *seen) if len(self.firsts) < FIRSTS_KEPT - 1 else (step, None, None))

    def _add_scale(self, step: int, scale: float | None, skipped: bool, nonfinite: list[str]) -> None:
        if scale is not None:
            self.scaled_steps += 1
            if self.first_scaled is None:
                self.first_scaled = step
            if skipped:
                self.nonfinite.update(nonfinite)
                self.skipped += 1
        seen = ScaleStep(step, scale, skipped, nonfinite, self.peak)
        for unit in self._step_units:
            unit.observe(seen)
        if scale is not None and not skipped and (self.peak is None or scale > self.peak[0]):
            self.peak = (scale, step)

    # -- findings ---------------------------------------------------------------------------------
    def findings(self, dtype: str, *, device: dict[str, Any] | None = None,
                 first_nonfinite: dict[str, Any] | None = None, source: dict[str, Any] | None = None,
                 dtype_source: str | None = None) -> list[Finding]:
        """The run's AMP6xx findings; ``device``: the condition rows a Monitor kept on its
        device (``conditions.DeviceConditions.read``), added to the ones built here."""
        rows = dict(self.rows)
        params = {m: set(names) for m, names in self.params.items()}
        if device:
            rows.update(device["rows"])
            for module, names in device["params"].items():
                params.setdefault(module, set()).update(names)
        run = Run(LowDtype.parse(dtype), self.scaled_steps > 0, self.first_scaled, params, first_nonfinite,
                  self.nonfinite, computes_low=computes_low(dtype_source), skipped=self.skipped,
                  firsts=tuple(self.firsts))
        file, line = _where(source)
        found: list[tuple[tuple, Finding]] = []
        for code, unit in self.units.items():
            if isinstance(unit, ModuleRule):
                verdicts = unit.report({(m, p): Row(*row) for (c, m, p), row in rows.items() if c == code}, run)
            else:
                verdicts = unit.report(run)
            info = rule(code)  # the message names the module too: {module} is one of its fields
            for v in verdicts:
                finding = Finding(code, info.severity, info.format(**v.fields), file, line, module=v.module, fix=v.fix)
                found.append(((code, v.first, v.module or "", finding.message), finding))
        return [finding for _, finding in sorted(found, key=lambda item: item[0])]


def computes_low(dtype_source: str | None) -> bool | None:
    """Whether a run computes in the dtype it is audited for, from how that dtype was found
    (``hooks.detect_dtype``): autocast's or the model's own, yes; the default (no low dtype
    seen: an fp32 run), no; given by the user (or unknown), None."""
    if not dtype_source or dtype_source == "given":
        return None
    return not dtype_source.startswith("default")


def _where(source: dict[str, Any] | None) -> tuple[str, int]:
    if source and isinstance(source.get("file"), str) and isinstance(source.get("line"), int):
        return source["file"], source["line"]
    return "<watch>", 0


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def caller_source() -> dict[str, Any] | None:
    """Where the watch was created: the first frame outside ampaudit (``with
    ampaudit.watch(...)`` in the user's script), its file relative to the working folder
    when inside it. The findings point there."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        path = os.path.abspath(filename)
        if not path.startswith(_PACKAGE + os.sep) and not filename.startswith("<frozen"):
            if not filename.startswith("<"):
                relative = os.path.relpath(path)
                filename = relative if not relative.startswith("..") else path
            return {"file": filename, "line": frame.f_lineno}
        frame = frame.f_back
    return None
