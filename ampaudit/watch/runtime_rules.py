"""The runtime rules (AMP6xx, and AMP75x over ``fp8=True``'s float8 rows): watch's verdicts on
a run, one unit per rule.

Each rule's condition is written once, over a ``StatsView`` (``rule_api.py`` says what it
may use): the host runs it over a log's records (``verdicts.py``), the device over a step's
rows when no log is written (``conditions.py``). Thresholds are ``[AMP6nn.params]`` of
rules/rules.toml, messages and fixes its ``message`` and ``[AMP6nn.hints]``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

from ampaudit.watch.rule_api import (
    Condition,
    Fp8Rows,
    Fp8Rule,
    GradientRule,
    LayerRule,
    Row,
    Run,
    ScaleStep,
    StatsView,
    Step,
    StepRule,
    Value,
    Verdict,
    names,
    owner,
    percent,
    runtime_rule,
    scale_text,
    steps_text,
    where,
)

_FP32_NORMAL = 2.0**-126


@runtime_rule("AMP601")
class GradientUnderflow(GradientRule):
    """Of a module's parameter-gradient elements, the share that is zero or below the dtype's
    smallest normal *at the step's loss scale* reaches ``min_share``. With a GradScaler watch
    records the gradients after ``scaler.step()`` unscaled them, so each magnitude bin is
    multiplied back by the scale. Zeros count only in a tensor whose nonzero values are mostly
    (``zero_share``) below it too: zeros beside healthy magnitudes are structure (dead ReLU
    units). A tensor with no nonzero value counts only in a step whose gradients show a flush -
    their nonzero values, all parameters together, mostly below it too, or none at all: an
    all-zero gradient beside healthy ones is structure as well (the layers before a
    zero-initialised output projection or head, LoRA's A while B is zero), as underflow
    leaves small nonzero values where it starts. A tensor holding NaN or Inf says nothing of
    underflow, nor does any gradient of a step the scaler skips: never applied, and its finite
    ones are often zeros that ``clip_grad_norm_`` made of an infinite norm."""

    def step_sums(self, s: StatsView, step: Step) -> tuple[Value, Value]:
        finite = (s.nan + s.inf) == 0
        return where(finite, s.below(step.limits.normal, step.scale), 0), where(finite, s.nonzero, 0)

    def measure(self, s: StatsView, step: Step) -> tuple[Value, Value]:
        share = self.params["zero_share"]
        under = s.below(step.limits.normal, step.scale)
        small, nonzero = step.sums  # the step's: below the smallest normal, and all finite nonzero values
        flushed = small >= share * nonzero  # (none at all, too)
        mostly_small = (s.nonzero > 0) & (under >= share * s.nonzero)
        zeros = where(mostly_small | ((s.nonzero == 0) & flushed), s.zero, 0)
        if step.limits.normal <= _FP32_NORMAL:  # bfloat16, fp32's range: its zeros were never flushed
            zeros = 0
        counted = where(step.skipped, False, (s.nan + s.inf) == 0)
        return where(counted, under + zeros, 0), where(counted, s.numel, 0)

    def condition(self, lost: Value, numel: Value, step: Step) -> Value:
        return (numel > 0) & (lost >= self.params["min_share"] * numel)

    def report(self, rows: dict[tuple[str, str], Row], run: Run) -> Iterator[Verdict]:
        # a scale that overflow keeps low (skipped steps): raising init_scale only skips more
        fix = self.hints["after_skips" if run.skipped else "with_scaler" if run.scaled else "without_scaler"]
        dtype = run.limits.name
        lost = {True: "those updates are lost", None: f"in {dtype} those updates are lost",
                False: f"in {dtype} those updates would be lost (this run computes in a wider dtype)"}[run.computes_low]
        for (module, _), row in rows.items():
            if row.count >= self.params["min_steps"]:
                yield Verdict(row.first, module, fix, dict(
                    share=percent(row.sum_value / row.sum_total), module=module,
                    params=names(sorted(run.params.get(module, ()))), dtype=dtype,
                    at_scale="at the loss scale" if run.scaled else "with no loss scale", steps=steps_text(row),
                    lost=lost))


@runtime_rule("AMP602")
class ActivationHeadroom(LayerRule):
    """A module's finite forward absmax >= the dtype's max / ``factor``."""

    def condition(self, s: StatsView, step: Step) -> Condition:
        return Condition(s.absmax >= step.limits.max / self.params["factor"], s.absmax, s.numel)

    def report(self, rows: dict[tuple[str, str], Row], run: Run) -> Iterator[Verdict]:
        for (module, _), row in rows.items():
            if row.count >= 1:
                limit, dtype = run.limits.max, run.limits.name
                if row.peak > limit:  # past the max: a run that does not compute in the dtype (fp32)
                    headroom = f"{row.peak / limit:.3g}x past {dtype}'s max {limit:g}: it overflows to inf in {dtype}"
                else:
                    headroom = (f"within {self.params['factor']:g}x of {dtype}'s max {limit:g}, a step away from "
                                "overflowing to inf")
                yield Verdict(row.first, module, self.hints.get("fix"), dict(
                    module=module, absmax=f"{row.peak:.5g}", steps=steps_text(row), headroom=headroom))


@runtime_rule("AMP603")
class LossScaleCollapse(StepRule):
    """The loss scale a step used fell below ``min_scale``, or ``max_drop`` times below the
    highest scale a step was applied with; reported once, at its lowest."""

    def __init__(self) -> None:
        super().__init__()
        self.collapse: dict[str, Any] | None = None

    def observe(self, step: ScaleStep) -> None:
        if step.scale is None:
            return
        below = step.scale < self.params["min_scale"]
        dropped = step.peak is not None and step.scale * self.params["max_drop"] <= step.peak[0]
        if below or dropped:
            c = self.collapse
            if c is None:
                c = self.collapse = {"first": step.step, "count": 0, "low": math.inf}
            c["last"], c["count"] = step.step, c["count"] + 1
            if step.scale < c["low"]:
                c.update(low=step.scale, low_step=step.step, peak=step.peak)

    def report(self, run: Run) -> Iterator[Verdict]:
        c = self.collapse
        if c is None:
            return
        top = run.nonfinite.most_common(1)
        culprit = top[0][0] if top else None
        min_scale = self.params["min_scale"]
        if c["low"] < min_scale:
            reason = f"below {min_scale:g}"
        else:
            peak, peak_step = c["peak"]
            reason = (f"{scale_text(peak / c['low'])}x below {scale_text(peak)}, "
                      f"the scale step {peak_step} was applied with")
        yield Verdict(c["first"], owner(culprit) if culprit else None, self.hints.get("fix"), dict(
            low=scale_text(c["low"]), low_step=c["low_step"], reason=reason,
            steps=f"; in {c['count']} logged steps from {c['first']} to {c['last']}" if c["count"] > 1 else "",
            where=f"; non-finite gradients most often in `{culprit}`" if culprit else ""))


@runtime_rule("AMP604")
class PersistentSkippedSteps(StepRule):
    """``in_a_row`` or more consecutive logged steps skipped by the GradScaler."""

    def __init__(self) -> None:
        super().__init__()
        self.run: dict[str, Any] | None = None  # the current run of skipped steps
        self.best: dict[str, Any] | None = None  # the longest, without its Counter

    def observe(self, step: ScaleStep) -> None:
        if step.scale is None or not step.skipped:
            self.run = None
            return
        run = self.run
        if run is None:
            run = self.run = {"first": step.step, "count": 0, "scale_first": step.scale, "params": Counter()}
        run["last"], run["count"], run["scale_last"] = step.step, run["count"] + 1, step.scale
        run["params"].update(step.nonfinite)
        if self.best is None or run["count"] > self.best["count"]:
            top = run["params"].most_common(1)
            self.best = {k: v for k, v in run.items() if k != "params"}
            self.best["param"] = top[0][0] if top else None

    def report(self, run: Run) -> Iterator[Verdict]:
        best = self.best
        if best is None or best["count"] < self.params["in_a_row"]:
            return
        param = best["param"]
        yield Verdict(best["first"], owner(param) if param else None,
                      self.hints.get("at_start" if best["first"] == run.first_scaled else "fix"), dict(
                          count=best["count"], first=best["first"], last=best["last"],
                          scale_first=scale_text(best["scale_first"]), scale_last=scale_text(best["scale_last"]),
                          where=f"; non-finite gradients most often in `{param}`" if param else ""))


@runtime_rule("AMP605")
class AlwaysNonfinite(LayerRule):
    """NaN or Inf in a module's forward output, or in its output's gradient when no GradScaler
    is watched (with one, a non-finite gradient is a skipped step: AMP603/AMP604), in a run of
    ``min_steps`` consecutive logged steps. In a forward output -inf is what a mask writes
    (``masked_fill(upper, -inf)``, ``scores + mask``): NaN and +inf count there, as for the
    first non-finite of a module found to write masks; a -inf that arithmetic made is named by
    the first non-finite's replay, and the NaN it leads to counts here. Modules non-finite over
    the same steps are one finding, under the one that went non-finite first."""

    phases = ("forward", "backward")

    def condition(self, s: StatsView, step: Step) -> Condition:
        bad = s.nan + s.inf - where(s.in_phase("forward"), s.neginf, 0)
        return Condition((bad > 0) & (s.in_phase("forward") | (step.scale is None)), bad, s.numel)

    def report(self, rows: dict[tuple[str, str], Row], run: Run) -> Iterator[Verdict]:
        groups: dict[tuple[float, float, float], list[tuple[str, str]]] = {}
        for (module, phase), row in rows.items():
            if row.best_len >= self.params["min_steps"]:
                groups.setdefault((row.best_start, row.best_last, row.best_len), []).append((module, phase))
        first_nonfinite = run.first_nonfinite
        for (first, last, count), members in groups.items():
            # an enclosing module (the model, a block) only passes its child's NaN on: the
            # innermost lead, forward before backward
            members.sort(key=lambda mp, ms=tuple(members): (_encloses(mp[0], ms), mp[1] != "forward", mp[0]))
            # where it was born: the group's first step's own first non-finite (a later group:
            # the weights a bad step left NaN, first read by the model's first layer, not by the
            # name that sorts first), else the run's, in whichever phase this group holds it
            borns = [run.first_at(first)]
            if first_nonfinite and first <= first_nonfinite["step"] <= last:
                borns.append((first_nonfinite["module"], first_nonfinite["phase"]))
            lead = next((named for born in borns if born and (named := _born_in(born, members))), members[0])
            rest = [f"{m} ({p})" for m, p in members if (m, p) != lead]
            others = f"; also non-finite in those steps: {names(rest)}" if rest else ""
            yield Verdict(first, lead[0], self.hints.get("fix"), dict(
                module=lead[0], phase=lead[1], first=int(first), last=int(last), count=int(count), others=others))


def _born_in(born: tuple[str, str], members: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The member a value born in ``born`` (module, phase) is reported under: that module, or -
    born in its own body's backward (its output gradient finite, its input's not) - the modules
    inside it the gradient reaches first, not the model's first layer, which it reaches last and
    whose name sorts first."""
    module, phase = born
    named = [mp for mp in members if mp[0] == module] or \
        [mp for mp in members if mp[0].startswith(module + ".") and mp[1] == phase]
    named.sort(key=lambda mp: mp[1] != phase)
    return named[0] if named else None


def _run_step(state: dict[str, Any], rows: Fp8Rows, **sums: float) -> None:
    """One step a condition held in: the run it extends (consecutive logged steps), the longest,
    and sums over the steps it held in."""
    extends = state.get("last") == rows.prev and state.get("run", 0) > 0
    state["run"] = state["run"] + 1 if extends else 1
    state["run_start"] = state["run_start"] if extends else rows.step
    state.setdefault("first", rows.step)
    state["last"], state["count"] = rows.step, state.get("count", 0) + 1
    for name, value in sums.items():
        state[name] = state.get(name, 0) + value
    if state["run"] > state.get("best", 0):
        state.update(best=state["run"], best_start=state["run_start"], best_last=rows.step)


@runtime_rule("AMP750")
class Fp8AmaxSpike(Fp8Rule):
    """An operand's amax jumped ``min_ratio`` times or more past the largest amax of its history
    (the delayed recipe's scale): that scale would saturate the step's largest elements."""

    def __init__(self) -> None:
        super().__init__()
        self.spikes: dict[tuple[str, str], dict[str, Any]] = {}

    def observe(self, rows: Fp8Rows) -> None:
        for module, operand, row in rows.operands():
            history = row.get("history_amax", 0)
            # a non-finite amax (an inf or NaN element) is AMP60x's: no scale would hold it
            spike = (history > 0 and math.isfinite(row["amax"]) and math.isfinite(history)
                     and row["amax"] >= self.params["min_ratio"] * history)
            if spike and row.get("delayed_saturated", 0) > 0:
                state = self.spikes.setdefault((module, operand), {"peak": 0.0})
                _run_step(state, rows)
                ratio = row["amax"] / history
                if ratio > state["peak"]:
                    state.update(peak=ratio, peak_step=rows.step, format=row.get("format", "?"),
                                 share=row["delayed_saturated"] / max(row["numel"], 1))

    def report(self, run: Run) -> Iterator[Verdict]:
        for (module, operand), s in self.spikes.items():
            more = f" (in {s['count']} logged steps from {s['first']} to {s['last']})" if s["count"] > 1 else ""
            yield Verdict(s["first"], module, self.hints.get("fix"), dict(
                module=module, operand=operand, ratio=f"{s['peak']:.3g}", step=s["peak_step"], more=more,
                share=percent(s["share"]), format=s["format"]))


@runtime_rule("AMP751")
class Fp8GradientUnderflow(Fp8Rule):
    """Of a Linear's output gradient, the share of nonzero elements that round to zero in its
    float8 format (e5m2 in the tensorwise recipe) even at the step's own tensorwise scale reaches
    ``min_share``, in ``min_steps`` or more consecutive logged steps."""

    def __init__(self) -> None:
        super().__init__()
        self.lost: dict[str, dict[str, Any]] = {}

    def observe(self, rows: Fp8Rows) -> None:
        for module, operand, row in rows.operands():
            if operand != "grad_output" or not row.get("numel") or not math.isfinite(row["amax"]):
                continue  # a non-finite gradient (AMP60x's): its scale is 0 or NaN, so every element "flushes"
            if row["underflow"] >= self.params["min_share"] * row["numel"]:
                state = self.lost.setdefault(module, {"format": row.get("format", "?")})
                _run_step(state, rows, underflow=row["underflow"], numel=row["numel"])

    def report(self, run: Run) -> Iterator[Verdict]:
        for module, s in self.lost.items():
            if s["best"] >= self.params["min_steps"]:
                yield Verdict(s["first"], module, self.hints.get("fix"), dict(
                    module=module, share=percent(s["underflow"] / s["numel"]), format=s["format"],
                    steps=f"in {s['count']} logged steps from {s['first']} to {s['last']}",
                    run=f"{s['best']} in a row from step {s['best_start']}"))


def _encloses(module: str, members: tuple[tuple[str, str], ...]) -> bool:
    return any(other != module and (module == "(model)" or other.startswith(module + ".")) for other, _ in members)
