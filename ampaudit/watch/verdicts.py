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
from operator import itemgetter
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
    if cond:
        held(row, step, prev, value, total)


def held(row: list[float], step: int, prev: int, value: float, total: float) -> None:
    """``update_row`` of a step the condition held in, but for its count of steps seen."""
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
        self._fields: dict[Any, Column] = {}  # by field, and nonzero and below's: a rule asks again

    def field(self, name: str) -> Value:
        column = self._fields.get(name)
        if column is None:
            column = self._fields[name] = Column(map(itemgetter(_AT[name]), self._rows))
        return column

    @property
    def nonzero(self) -> Value:
        column = self._fields.get(_NONZERO)
        if column is None:  # the counts are whole numbers >= 0: their sum is HostView's
            column = self._fields[_NONZERO] = Column([sum(row[_HIST:]) for row in self._rows])
        return column

    def below(self, limit: float, scale: Value | None) -> Value:
        if isinstance(scale, Column):  # the host's scale is the step's: HostView takes this one
            raise TypeError("a Column of loss scales")
        last = self._below.get((limit, scale))
        if last is None:
            last = self._below[(limit, scale)] = last_bin_below(1.0 if scale is None else scale, limit)
        column = self._fields.get(last)
        if column is None:  # the counts of exponents hist_from (row[_HIST - 1]) to last
            column = self._fields[last] = Column([sum(row[_HIST:_HIST + last - row[_HIST - 1] + 1])
                                                  if last >= row[_HIST - 1] else 0 for row in self._rows])
        return column

    def in_phase(self, phase: str) -> Value:
        return Column([p == phase for p in self._phases])


_AT = {name: i for i, name in enumerate(LOG_ROW)}
_HIST = len(LOG_ROW)  # where a row's counts start
_NONZERO = ("nonzero",)  # ColumnView's key of its nonzero column (a field's is its name, below's an exponent)


class _Selection:
    """The keys of one rule over one line shape, in ``record_entries``' order, the rows they
    take, and the logged steps judged since their rows last counted them (``SEEN``, added
    at ``Verdicts.flush_seen``: the same count, without a Python step per key and step)."""

    __slots__ = ("index", "keys", "rows", "steps")

    def __init__(self, index: list[int], keys: list[Key], table: dict[Key, list[float]]) -> None:
        self.index, self.keys, self.steps = index, keys, 0
        for key in keys:  # created in record_entries' order, as update would
            if key not in table:
                table[key] = new_row()
        self.rows = [table[key] for key in keys]


def _layer_selection(shape: Shape, code: str, phases: tuple[str, ...]) -> tuple[list[int], list[Key]]:
    """The rows of ``shape`` in ``phases``, in ``record_entries``' order: by module, then phase."""
    at = {key: i for i, key in enumerate(shape.keys)}
    modules = dict.fromkeys(module for module, _ in shape.keys)
    keys = [(module, phase) for module in modules for phase in phases if (module, phase) in at]
    return [at[key] for key in keys], [(code, module, phase) for module, phase in keys]


def _owners(shape: Shape) -> tuple[list[str], dict[str, list[str]]]:
    """Each parameter's module, in the shape's order, and each module's parameters."""
    each = [owner(name) for name in shape.params]
    grouped: dict[str, list[str]] = {}
    for module, name in zip(each, shape.params, strict=True):
        grouped.setdefault(module, []).append(name)
    return each, grouped


def _as_dicts(record: dict[str, Any], matched: Matched) -> dict[str, Any]:
    """A record whose rows are lists (``line_shape``) with its rows as the Stats dicts
    ``record_entries`` reads."""
    shape, rows = matched
    stats = [stats_from_row(row, list(LOG_ROW)) for row in rows]
    layers: dict[str, dict[str, Any]] = {}
    for (module, phase), s in zip(shape.keys, stats, strict=False):
        layers.setdefault(module, {})[phase] = s
    return {**record, "layers": layers, "params": dict(zip(shape.params, stats[len(shape.keys):], strict=True))}


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
        self._selections: dict[tuple[Shape, str], _Selection] = {}  # per (shape, rule)
        self._shape_owners: dict[Shape, tuple[list[str], dict[str, list[str]]]] = {}  # ``_owners``, per shape
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
        and params hold lists then), judged a rule at a time over all of them (``ColumnView``)."""
        step = record["step"]
        limits = LowDtype.parse(record.get("dtype") or dtype)
        done = matched is not None and self._add_columns(record, matched, limits)
        if not done:
            if matched is not None:  # a rule not written for columns: tensor by tensor, from the rows' dicts
                record = _as_dicts(record, matched)
            entries, params = record_entries(record, limits, self._module_units)
            rows = self.rows
            for key, cond, value, total in entries:
                row = rows.get(key)
                if row is None:
                    row = rows[key] = new_row()
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

    def _add_columns(self, record: dict[str, Any], matched: Matched, limits: LowDtype) -> bool:
        """``add``'s rows of a step ``line_shape`` proved, each rule run once over all its
        tensors (``ColumnView``: the numbers ``HostView`` gives, as Columns) - the same
        arithmetic, the same rows. False, nothing changed, where a rule is not written for
        columns (it asked a Column for its truth: TypeError)."""
        shape, rows = matched
        step = Step(limits, record.get("scale"), skipped=bool(record.get("skipped")))
        below: dict[tuple[float, Any], int] = {}
        judged = []  # (selection, holds, value, total), applied once every rule ran
        try:
            for unit in self._module_units:
                if isinstance(unit, LayerRule):
                    chosen = self._selection(shape, unit, None)
                    n = len(chosen.index)
                    if n:
                        view = ColumnView([rows[i] for i in chosen.index], [k[2] for k in chosen.keys], below)
                        holds, value, total = unit.condition(view, step)
                        judged.append((chosen, spread(holds, n), spread(value, n), spread(total, n), True))
                elif isinstance(unit, GradientRule) and shape.params:
                    judged.append(self._gradients(unit, shape, rows[len(shape.keys):], step, below))
        except TypeError:
            return False
        step_at, prev = record["step"], self._prev
        for chosen, holds, values, totals, as_float in judged:
            chosen.steps += 1
            for i, h in enumerate(holds):
                if h:
                    v, t = values[i], totals[i]
                    held(chosen.rows[i], step_at, prev, float(v) if as_float else v, float(t) if as_float else t)
        for module, names in self._owners(shape)[1].items():
            self.params.setdefault(module, set()).update(names)
        return True

    def _gradients(self, unit: GradientRule, shape: Shape, rows: list[list], step: Step,
                   below: dict[tuple[float, Any], int]) -> tuple:
        """A GradientRule over the step's parameter rows: ``record_entries``' sums, per module."""
        n = len(rows)
        view = ColumnView(rows, [GRADIENTS] * n, below)
        at = replace(step, sums=tuple(sum(spread(column, n)) for column in unit.step_sums(view, step)))
        value, total = unit.measure(view, at)
        sums: dict[str, list[float]] = {}
        for module, v, t in zip(self._owners(shape)[0], spread(value, n), spread(total, n), strict=True):
            acc = sums.setdefault(module, [0.0, 0.0])
            acc[0] += v
            acc[1] += t
        values, totals = Column([a[0] for a in sums.values()]), Column([a[1] for a in sums.values()])
        holds = spread(unit.condition(values, totals, step), len(values))
        return self._selection(shape, unit, list(sums)), [bool(h) for h in holds], values, totals, False

    def _selection(self, shape: Shape, unit: ModuleRule, modules: list[str] | None) -> _Selection:
        chosen = self._selections.get((shape, unit.code))
        if chosen is None:
            if len(self._selections) > 64:  # shapes come and go: keep a few
                self.flush_seen()
                self._selections.clear()
                self._shape_owners.clear()
            if modules is None:
                index, keys = _layer_selection(shape, unit.code, unit.phases)
            else:
                index, keys = list(range(len(modules))), [(unit.code, m, GRADIENTS) for m in modules]
            chosen = self._selections[(shape, unit.code)] = _Selection(index, keys, self.rows)
        return chosen

    def _owners(self, shape: Shape) -> tuple[list[str], dict[str, list[str]]]:
        found = self._shape_owners.get(shape)
        if found is None:
            found = self._shape_owners[shape] = _owners(shape)
        return found

    def flush_seen(self) -> None:
        """The steps each selection judged, added to its rows' ``SEEN``."""
        for chosen in self._selections.values():
            if chosen.steps:
                for row in chosen.rows:
                    row[SEEN] += chosen.steps
                chosen.steps = 0

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
        self.flush_seen()
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
