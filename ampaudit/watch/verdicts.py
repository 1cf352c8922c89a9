"""Verdicts, not only counts: the AMP6xx findings of a watched run (rules/rules.toml).

Torch-free: ``ampaudit report`` builds them from a log as it streams, and a Monitor from the
records it makes; both go through ``SummaryBuilder`` (``watch/summary.py``), so a run gives
the same findings live and from its log. Memory stays constant however long the run:

- per (rule, module, phase), one *condition row* (``COLUMNS``): the first and last logged
  step the rule's condition held, in how many, the longest run of consecutive logged steps
  it held in, and sums over those steps. A Monitor without a log keeps the same rows on the
  device (``watch/conditions.py``, a few tensor ops per step, no host sync) and hands them
  over at ``summary()``;
- for the loss scale: the longest run of skipped steps, and the lowest scale against the
  highest one a step was applied with.

The conditions, per logged step (thresholds are ``[AMP60x.params]``):

- AMP601, per module: of its parameters' gradient elements, the share that is zero or below
  the dtype's smallest normal *at the step's loss scale* reaches ``min_share``. With a
  GradScaler watch records parameter gradients after ``scaler.step()`` unscaled them, so each
  histogram bin is multiplied back by the scale; zeros count only in a tensor that also
  holds mostly (``zero_share``) such values among its nonzero ones, or nothing else; a
  tensor holding NaN or Inf (a step the scaler skips) is left out.
- AMP602, per module: the forward output's finite absmax >= the dtype's max / ``factor``.
- AMP605, per module and phase: NaN or Inf in the forward output, or in the output's
  gradient when no GradScaler is watched (with one, a non-finite gradient is a skipped
  step: AMP603/AMP604); reported for a run of ``min_steps`` consecutive logged steps.
- AMP603 and AMP604 read the step's loss scale, whether the scaler skipped it, and the
  parameters whose gradients were non-finite.
"""

from __future__ import annotations

import math
import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ampaudit.core.dtypes import LowDtype
from ampaudit.core.findings import Finding
from ampaudit.core.rulebook import rule

UNDERFLOW, HEADROOM, SCALE_COLLAPSE, SKIPS, NONFINITE = "AMP601", "AMP602", "AMP603", "AMP604", "AMP605"
RUNTIME_RULES = (UNDERFLOW, HEADROOM, SCALE_COLLAPSE, SKIPS, NONFINITE)
GRADIENTS = "grad"  # the phase of AMP601's rows: a module's parameter gradients

# A condition row. The first UNSET columns start at -1 (no step yet), the others at 0.
COLUMNS = ("first", "last", "run_start", "best_start", "best_last",
           "count", "seen", "run_len", "best_len", "sum_a", "sum_b", "peak")
FIRST, LAST, RUN_START, BEST_START, BEST_LAST, COUNT, SEEN, RUN_LEN, BEST_LEN, SUM_A, SUM_B, PEAK = range(12)
UNSET = 5

Key = tuple[str, str, str]  # (rule, module, phase)


@dataclass(frozen=True)
class Thresholds:
    """The rules' thresholds, from rules.toml."""

    min_share: float
    zero_share: float
    underflow_steps: int
    factor: float
    min_scale: float
    max_drop: float
    in_a_row: int
    nonfinite_steps: int

    @classmethod
    def load(cls) -> Thresholds:
        p = {code: rule(code).params for code in RUNTIME_RULES}
        return cls(min_share=float(p[UNDERFLOW]["min_share"]), zero_share=float(p[UNDERFLOW]["zero_share"]),
                   underflow_steps=int(p[UNDERFLOW]["min_steps"]),
                   factor=float(p[HEADROOM]["factor"]), min_scale=float(p[SCALE_COLLAPSE]["min_scale"]),
                   max_drop=float(p[SCALE_COLLAPSE]["max_drop"]), in_a_row=int(p[SKIPS]["in_a_row"]),
                   nonfinite_steps=int(p[NONFINITE]["min_steps"]))


def new_row() -> list[float]:
    return [-1.0] * UNSET + [0.0] * (len(COLUMNS) - UNSET)


def update_row(row: list[float], step: int, prev: int, cond: bool, a: float, b: float) -> None:
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
    row[SUM_A] += a
    row[SUM_B] += b
    row[PEAK] = max(row[PEAK], a)


def owner(param: str) -> str:
    """The module a parameter belongs to: ``blocks.0.fc.weight`` -> ``blocks.0.fc``."""
    return param.rpartition(".")[0] or "(model)"


def last_bin_below(scale: float, limits: LowDtype) -> int:
    """The highest exponent e whose bin [2^e, 2^(e+1)), multiplied by ``scale``, lies wholly
    below the dtype's smallest normal: 2^(e+1) * scale <= normal (exact: a product with a
    power of two, as on the device)."""
    if not 0 < scale < math.inf:  # 0: every bin; inf or NaN: none (as the device's comparison)
        return 10**6 if scale == 0 else -(10**6)
    e = math.floor(math.log2(limits.normal) - math.log2(scale)) - 1
    while math.ldexp(scale, e + 2) <= limits.normal:
        e += 1
    while math.ldexp(scale, e + 1) > limits.normal:
        e -= 1
    return e


def lost_gradients(stats: dict[str, Any], last_below: int, zero_share: float) -> int:
    """AMP601's count for one gradient tensor: values in bins up to ``last_below`` (below the
    smallest normal at the step's scale), plus its exact zeros when at least ``zero_share`` of
    its nonzero values are below it too (the magnitudes run off the bottom of the dtype) or it
    has none."""
    hist, zero = stats["hist"], stats["zero"]
    under = 0
    for e, c in hist:  # in ascending order of e
        if e > last_below:
            break
        under += c
    if zero and (not hist or under >= zero_share * sum(c for _, c in hist)):
        return under + zero
    return under


def record_entries(record: dict[str, Any], limits: LowDtype, t: Thresholds
                   ) -> tuple[list[tuple[Key, bool, float, float]], dict[str, list[str]]]:
    """A log record's conditions: (key, holds, a, b) per key, and each module's parameters."""
    scale = record.get("scale")
    entries: list[tuple[Key, bool, float, float]] = []
    for module, phases in record["layers"].items():
        for phase in ("forward", "backward"):
            s = phases.get(phase)
            if s is None:
                continue
            bad = s["nan"] + s["inf"]
            entries.append(((NONFINITE, module, phase), bad > 0 and (phase == "forward" or scale is None),
                            float(bad), float(s["numel"])))
            if phase == "forward":
                entries.append(((HEADROOM, module, phase), s["absmax"] >= limits.max / t.factor,
                                float(s["absmax"]), float(s["numel"])))
    lost: dict[str, list[float]] = {}
    params: dict[str, list[str]] = {}
    last_below = last_bin_below(scale if scale is not None else 1.0, limits) if record["params"] else 0
    for name, s in record["params"].items():
        module = owner(name)
        params.setdefault(module, []).append(name)
        total = lost.setdefault(module, [0.0, 0.0])
        if s["nan"] + s["inf"]:
            continue  # it overflowed (a step the scaler skips): not a verdict on underflow
        total[0] += lost_gradients(s, last_below, t.zero_share)
        total[1] += s["numel"]
    for module, (bad, numel) in lost.items():
        entries.append(((UNDERFLOW, module, GRADIENTS), numel > 0 and bad >= t.min_share * numel, bad, numel))
    return entries, params


class Verdicts:
    """The state the AMP6xx rules need, fed one record (logged step) at a time."""

    def __init__(self) -> None:
        self.thresholds = Thresholds.load()
        self.rows: dict[Key, list[float]] = {}
        self.params: dict[str, set[str]] = {}  # module -> its parameters seen with gradients
        self._prev = -1  # the logged step before
        # the loss scale
        self.scaled_steps = 0
        self._first_scaled: int | None = None
        self._skip_run: dict[str, Any] | None = None  # the current run of skipped steps
        self._skip_best: dict[str, Any] | None = None  # the longest
        self._peak: tuple[float, int] | None = None  # the highest scale a step was applied with, its step
        self._collapse: dict[str, Any] | None = None
        self._nonfinite = Counter()  # parameters non-finite on skipped steps

    def add(self, record: dict[str, Any], dtype: str) -> None:
        step = record["step"]
        limits = LowDtype.parse(record.get("dtype") or dtype)
        t = self.thresholds
        entries, params = record_entries(record, limits, t)
        for key, cond, a, b in entries:
            row = self.rows.get(key)
            if row is None:
                row = self.rows[key] = new_row()
            update_row(row, step, self._prev, cond, a, b)
        for module, names in params.items():
            self.params.setdefault(module, set()).update(names)
        self._add_scale(step, record.get("scale"), bool(record.get("skipped")), record.get("nonfinite_params") or [])
        self._prev = step

    def _add_scale(self, step: int, scale: float | None, skipped: bool, nonfinite: list[str]) -> None:
        if scale is None:
            self._skip_run = None
            return
        t = self.thresholds
        self.scaled_steps += 1
        if self._first_scaled is None:
            self._first_scaled = step
        below = scale < t.min_scale
        dropped = self._peak is not None and scale * t.max_drop <= self._peak[0]
        if below or dropped:
            c = self._collapse
            if c is None:
                c = self._collapse = {"first": step, "count": 0, "low": math.inf}
            c["last"], c["count"] = step, c["count"] + 1
            if scale < c["low"]:
                c.update(low=scale, low_step=step, peak=self._peak)
        if skipped:
            self._nonfinite.update(nonfinite)
            run = self._skip_run
            if run is None:
                run = self._skip_run = {"first": step, "count": 0, "scale_first": scale, "params": Counter()}
            run["last"], run["count"], run["scale_last"] = step, run["count"] + 1, scale
            run["params"].update(nonfinite)
            if self._skip_best is None or run["count"] > self._skip_best["count"]:
                top = run["params"].most_common(1)
                self._skip_best = {k: v for k, v in run.items() if k != "params"}
                self._skip_best["param"] = top[0][0] if top else None
        else:
            self._skip_run = None
            if self._peak is None or scale > self._peak[0]:
                self._peak = (scale, step)

    # -- findings ---------------------------------------------------------------------------------
    def findings(self, dtype: str, *, device: dict[str, Any] | None = None,
                 first_nonfinite: dict[str, Any] | None = None, source: dict[str, Any] | None = None
                 ) -> list[Finding]:
        """The run's AMP6xx findings; ``device``: the condition rows a Monitor kept on its
        device (``conditions.DeviceConditions.read``), added to the ones built here."""
        rows = dict(self.rows)
        params = {m: set(names) for m, names in self.params.items()}
        if device:
            rows.update(device["rows"])
            for module, names in device["params"].items():
                params.setdefault(module, set()).update(names)
        limits = LowDtype.parse(dtype)
        file, line = _where(source)
        found: list[tuple[tuple, Finding]] = []

        def add(code: str, first: float, where: str | None, fix: str | None, /, **fields: Any) -> None:
            info = rule(code)  # the message names the module too: {module} is one of its fields
            finding = Finding(code, info.severity, info.format(**fields), file, line, module=where, fix=fix)
            found.append(((code, first, where or ""), finding))

        t = self.thresholds
        scaled = self.scaled_steps > 0
        hints = rule(UNDERFLOW).hints
        for (code, module, _phase), row in rows.items():
            if code == UNDERFLOW and row[COUNT] >= t.underflow_steps:
                share = row[SUM_A] / row[SUM_B]
                add(code, row[FIRST], module, hints["with_scaler" if scaled else "without_scaler"],
                    share=_percent(share), module=module, params=_names(sorted(params.get(module, ()))),
                    dtype=limits.name, at_scale="at the loss scale" if scaled else "with no loss scale",
                    steps=_steps(row[FIRST], row[LAST], row[COUNT]))
            elif code == HEADROOM and row[COUNT] >= 1:
                add(code, row[FIRST], module, rule(code).hints.get("fix"), module=module,
                    absmax=f"{row[PEAK]:.5g}", steps=_steps(row[FIRST], row[LAST], row[COUNT]),
                    factor=f"{t.factor:g}", dtype=limits.name, limit=f"{limits.max:g}")
        self._nonfinite_findings(rows, first_nonfinite, add)
        self._scale_findings(add)
        return [finding for _, finding in sorted(found, key=lambda item: item[0])]

    def _nonfinite_findings(self, rows: dict[Key, list[float]], first_nonfinite: dict[str, Any] | None,
                            add) -> None:
        groups: dict[tuple[float, float, float], list[tuple[str, str]]] = {}
        for (code, module, phase), row in rows.items():
            if code == NONFINITE and row[BEST_LEN] >= self.thresholds.nonfinite_steps:
                groups.setdefault((row[BEST_START], row[BEST_LAST], row[BEST_LEN]), []).append((module, phase))
        for (first, last, count), members in groups.items():
            members.sort(key=lambda mp: (mp[1] != "forward", mp[0]))
            lead = members[0]
            if first_nonfinite and first <= first_nonfinite["step"] <= last:
                named = (first_nonfinite["module"], first_nonfinite["phase"])
                if named in members:
                    lead = named
            rest = [f"{m} ({p})" for m, p in members if (m, p) != lead]
            others = f"; also non-finite in those steps: {_names(rest)}" if rest else ""
            add(NONFINITE, first, lead[0], rule(NONFINITE).hints.get("fix"), module=lead[0], phase=lead[1],
                first=_int(first), last=_int(last), count=_int(count), others=others)

    def _scale_findings(self, add) -> None:
        t = self.thresholds
        top = self._nonfinite.most_common(1)
        culprit = top[0][0] if top else None
        c = self._collapse
        if c is not None:
            if c["low"] < t.min_scale:
                reason = f"below {t.min_scale:g}"
            else:
                peak, peak_step = c["peak"]
                reason = f"{_scale(peak / c['low'])}x below {_scale(peak)}, the scale step {peak_step} was applied with"
            add(SCALE_COLLAPSE, c["first"], owner(culprit) if culprit else None,
                rule(SCALE_COLLAPSE).hints.get("fix"), low=_scale(c["low"]), low_step=c["low_step"],
                reason=reason,
                steps=f"; in {c['count']} logged steps from {c['first']} to {c['last']}" if c["count"] > 1 else "",
                where=f"; non-finite gradients most often in `{culprit}`" if culprit else "")
        best = self._skip_best
        if best is not None and best["count"] >= t.in_a_row:
            param = best["param"]
            hints = rule(SKIPS).hints
            add(SKIPS, best["first"], owner(param) if param else None,
                hints.get("at_start" if best["first"] == self._first_scaled else "fix"),
                count=best["count"], first=best["first"], last=best["last"], scale_first=_scale(best["scale_first"]),
                scale_last=_scale(best["scale_last"]),
                where=f"; non-finite gradients most often in `{param}`" if param else "")


def _int(value: float) -> int:
    return int(value)


def _steps(first: float, last: float, count: float) -> str:
    if count == 1:
        return f"at step {_int(first)}"
    return f"in {_int(count)} logged steps from {_int(first)} to {_int(last)}"


def _scale(value: float) -> str:
    """A loss scale: a large or small power of two as one (2**40), else as a number."""
    mantissa, exponent = math.frexp(value)
    if mantissa == 0.5 and abs(exponent - 1) >= 10:
        return f"2**{exponent - 1}"
    return f"{value:g}"


def _percent(share: float) -> str:
    text = f"{100 * share:.1f}%"
    return text.replace(".0%", "%")


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


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
