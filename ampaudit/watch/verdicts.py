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
from ampaudit.watch.columns import Column, spread
from ampaudit.watch.line_shape import Matched, Shape
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
from ampaudit.watch.stats_merge import LOG_ROW, stats_from_row

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


class ColumnView(StatsView):
    """Tensors of a logged step at once - their rows as ``line_shape`` proved them: lists of
    the log row's fields (``stats_merge.LOG_ROW``), then the counts from hist_from - as a
    condition reads them: a ``Column`` per field, the same numbers ``HostView`` gives one by one."""

    def __init__(self, rows: list[list], phases: list[str], below: dict[tuple[float, Any], int]) -> None:
        self._rows, self._phases, self._below = rows, phases, below
        self._fields: dict[str, Column] = {}

    def field(self, name: str) -> Value:
        column = self._fields.get(name)
        if column is None:
            at = _AT[name]
            column = self._fields[name] = Column([row[at] for row in self._rows])
        return column

    @property
    def nonzero(self) -> Value:
        return Column([sum(row[_HIST:]) for row in self._rows])  # the counts are whole numbers >= 0

    def below(self, limit: float, scale: Value | None) -> Value:
        if isinstance(scale, Column):  # the host's scale is the step's: HostView takes this one
            raise TypeError("a Column of loss scales")
        last = self._below.get((limit, scale))
        if last is None:
            last = self._below[(limit, scale)] = last_bin_below(1.0 if scale is None else scale, limit)
        under = []
        for row in self._rows:  # counts from exponent hist_from (row[_HIST - 1]) up, the first last - hist_from + 1
            n = last - row[_HIST - 1] + 1
            under.append(sum(row[_HIST:_HIST + n]) if n > 0 else 0)
        return Column(under)

    def in_phase(self, phase: str) -> Value:
        return Column([p == phase for p in self._phases])


_AT = {name: i for i, name in enumerate(LOG_ROW)}
_HIST = len(LOG_ROW)  # where a row's counts start


def column_entries(record: dict[str, Any], matched: Matched, limits: LowDtype, units: list[ModuleRule],
                   selections: dict[tuple, Any]) -> tuple[list[tuple[Key, bool, float, float]], dict[str, list[str]]]:
    """``record_entries`` of a record whose rows ``line_shape`` proved (``matched``), each
    rule's condition run once over all its tensors (``ColumnView``) - the same entries, in the
    same order. ``selections``: the rows each set of phases takes, per shape, kept between
    steps. A rule that is not written for columns (it asks a Column for its truth) is run
    tensor by tensor, as ``record_entries``."""
    try:
        return _column_entries(record, matched, limits, units, selections)
    except TypeError:
        shape, rows = matched
        stats = [stats_from_row(row, LOG_ROW) for row in rows]
        layers: dict[str, dict[str, Any]] = {}
        for (module, phase), s in zip(shape.keys, stats, strict=False):
            layers.setdefault(module, {})[phase] = s
        params = dict(zip(shape.params, stats[len(shape.keys):], strict=True))
        return record_entries({**record, "layers": layers, "params": params}, limits, units)


def _selection(shape: Shape, phases: tuple[str, ...], selections: dict[tuple, Any]) -> tuple[list[int], list[Key]]:
    """The rows of ``shape`` in ``phases``, in ``record_entries``' order: by module, then phase."""
    found = selections.get((shape, phases))
    if found is None:
        if len(selections) > 64:  # shapes come and go: keep a few
            selections.clear()
        at = {key: i for i, key in enumerate(shape.keys)}
        modules = dict.fromkeys(module for module, _ in shape.keys)
        keys = [(module, phase) for module in modules for phase in phases if (module, phase) in at]
        found = selections[(shape, phases)] = ([at[key] for key in keys], keys)
    return found


def _owners(shape: Shape, selections: dict[tuple, Any]) -> dict[str, list[str]]:
    found = selections.get((shape, None))
    if found is None:
        found = selections[(shape, None)] = {}
        for name in shape.params:
            found.setdefault(owner(name), []).append(name)
    return found


def _column_entries(record: dict[str, Any], matched: Matched, limits: LowDtype, units: list[ModuleRule],
                    selections: dict[tuple, Any]) -> tuple[list[tuple[Key, bool, float, float]], dict[str, list[str]]]:
    shape, rows = matched
    step = Step(limits, record.get("scale"), skipped=bool(record.get("skipped")))
    below: dict[tuple[float, Any], int] = {}
    entries: list[tuple[Key, bool, float, float]] = []
    params = shape.params
    for unit in units:
        if isinstance(unit, LayerRule):
            index, keys = _selection(shape, unit.phases, selections)
            n = len(index)
            if n:
                view = ColumnView([rows[i] for i in index], [phase for _, phase in keys], below)
                holds, value, total = unit.condition(view, step)
                code = unit.code
                entries.extend(((code, module, phase), bool(h), float(v), float(t)) for (module, phase), h, v, t
                               in zip(keys, spread(holds, n), spread(value, n), spread(total, n), strict=True))
        elif isinstance(unit, GradientRule):
            n = len(params)
            at = step
            view = ColumnView(rows[len(shape.keys):], [GRADIENTS] * n, below)
            if n:
                at = replace(step, sums=tuple(sum(spread(column, n)) for column in unit.step_sums(view, step)))
            sums: dict[str, list[float]] = {}
            if n:
                value, total = unit.measure(view, at)
                for name, v, t in zip(params, spread(value, n), spread(total, n), strict=True):
                    acc = sums.setdefault(owner(name), [0.0, 0.0])
                    acc[0] += v
                    acc[1] += t
            modules = list(sums)
            if modules:
                values, totals = Column([a[0] for a in sums.values()]), Column([a[1] for a in sums.values()])
                holds = spread(unit.condition(values, totals, step), len(modules))
                entries.extend(((unit.code, module, GRADIENTS), bool(h), v, t)
                               for module, h, v, t in zip(modules, holds, values, totals, strict=True))
    return entries, _owners(shape, selections)


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
        self._selections: dict[tuple, Any] = {}  # column_entries' rows per shape and phases
        self.params: dict[str, set[str]] = {}  # module -> its parameters seen with gradients
        self._prev = -1  # the logged step before
        # the loss scale, for every step rule
        self.scaled_steps = 0
        self.first_scaled: int | None = None
        self.peak: tuple[float, int] | None = None  # the highest scale a step was applied with, its step
        self.nonfinite: Counter = Counter()  # parameters non-finite on skipped steps
        self.skipped = 0  # logged steps the GradScaler skipped
        self.firsts: list[tuple[int, str | None, str | None]] = []  # Run.firsts

    def add(self, record: dict[str, Any], dtype: str, matched: Matched | None = None) -> None:
        """One logged step; ``matched``: its rows as ``line_shape`` proved them (its layers
        and params hold lists then), judged a rule at a time over all of them."""
        step = record["step"]
        limits = LowDtype.parse(record.get("dtype") or dtype)
        if matched is not None:
            entries, params = column_entries(record, matched, limits, self._module_units, self._selections)
        else:
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
