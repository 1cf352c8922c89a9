"""The run summary, built from per-step records - the same whether the records come live from
a Monitor or from a log file (``ampaudit report``) - ending with its verdicts (``verdicts.py``)."""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

from ampaudit.core.findings import Finding
from ampaudit.watch.events import LOSS
from ampaudit.watch.line_shape import Matched
from ampaudit.watch.log_file import as_stats, open_rows
from ampaudit.watch.loss_notes import from_the_loss, named_later
from ampaudit.watch.row_totals import RowTotals
from ampaudit.watch.stats_merge import add_fp8, add_stats
from ampaudit.watch.verdicts import Verdicts, caller_source


def describe_first(first: dict[str, Any]) -> str:
    """The first non-finite value in words: where, and the op and line that made it if known."""
    where = "the loss" if first["phase"] == LOSS else f"{first['module']} ({first['phase']}, {first['tensor']})"
    text = f"first in {where} at step {first['step']}"
    if "rank" in first:
        text += f" on rank {first['rank']}"
    if first.get("op"):
        text += f": {first['op']}" + (f" at {first['source']}" if first.get("source") else "")
    return text


class SummaryBuilder:
    """Running totals, so memory stays flat however long the run (or the log) - but for the
    loss scale's history, 16 bytes a logged step (two arrays, not a list a step: 136 bytes),
    and the steps the scaler skipped."""

    def __init__(self, dtype: str, source: dict[str, Any] | None = None) -> None:
        self.dtype = dtype
        # where the findings point: {"file", "line"} of the watch's creation (default: the
        # first caller outside ampaudit), the script for `ampaudit run`, the log's header
        self.source = source if source is not None else caller_source()
        self.verdicts = Verdicts()
        self.dtype_source: str | None = None
        self.eval_forwards = 0  # the model's grad-disabled calls
        self.eval_recorded = False  # whether they were recorded (phase "eval"): the log's end says
        self.forks = 0  # processes forked while watching (not watched)
        self.final_scale: float | None = None  # the loss scale after the last update()
        self.steps = 0
        self.logged_steps = 0  # fewer than steps with every=N: the verdicts are of these
        self.cut_short = False  # a log read without its end line: the run may have gone on past it
        self.first_nonfinite: dict[str, Any] | None = None
        self.layers: dict[str, dict[str, dict]] = {}
        self.params: dict[str, dict] = {}
        self.scale_steps, self.scales = array("q"), array("d")  # the loss scale each logged step used
        self.skipped: list[int] = []
        self.nonfinite_params: dict[int, list[str]] = {}
        self.unmeasured: dict[str, int] = {}  # tensors watch skipped, by kind (sparse, nested, meta)
        self.fp8: dict[str, dict[str, Any]] = {}  # fp8=True: module -> {"kind", operand: totals}
        # ``add_rows``: the totals of the steps whose rows line_shape proved, kept as lists
        # until the first step that is not (or ``summary()``) turns them into Stats dicts
        self._rows: RowTotals | None = RowTotals()
        self._norms: dict[str, Any] = {}  # each parameter's last gradient norm (its Stats' "norm")
        self._scaled: dict[str, Any] = {}  # its overflow at the loss scale, summed (once a step has it)
        self._scaled_last: dict[str, bool] = {}  # whether its last step had that count

    def add_rows(self, record: dict[str, Any], matched: Matched | None, names: list[str], path: Path) -> None:
        """A record of a format-2 log (``log_file.open_rows``), its rows still lists: added as
        lists where ``line_shape`` proved them (``matched``), else as their Stats dicts
        (``log_file.as_stats``, and ``add``) - the same summary either way."""
        if "step" not in record:
            self.add(record)
            return
        norms, scaled = record.get("norms", {}), record.get("overflow_at_scale")
        if matched is None or self._rows is None or not isinstance(norms, dict) \
                or not (scaled is None or isinstance(scaled, dict)):
            self._stop_rows()
            as_stats(record, names, path)
            self.add(record)
            return
        shape, rows = matched
        self._rows.add(shape, rows)
        params = shape.params
        self._norms.update(zip(params, map(norms.get, params), strict=True))
        if scaled is not None:
            for name in params:
                self._scaled[name] = self._scaled.get(name, 0) + scaled.get(name, 0)
        self._scaled_last.update(dict.fromkeys(params, scaled is not None))
        self._add_record(record, matched)

    def _stop_rows(self) -> None:
        """The totals ``add_rows`` kept as lists, as the Stats dicts ``add`` would have made
        of the same steps; every step from here on is added by ``add``."""
        totals, self._rows = self._rows, None
        if not totals:
            return
        for (module, phase), total in totals.layers.items():
            self.layers.setdefault(module, {})[phase] = total.stats()
        for name, total in totals.params.items():
            self.params[name] = stats = total.stats()
            # add's order: "norm" and "overflow_at_scale" as the last step put them
            if name in self._scaled and not self._scaled_last[name]:
                stats["overflow_at_scale"] = self._scaled[name]
            stats["norm"] = self._norms[name]
            if name in self._scaled and self._scaled_last[name]:
                stats["overflow_at_scale"] = self._scaled[name]

    def add(self, record: dict[str, Any]) -> None:
        """One logged step: {"step", "layers", "params", "scale", "skipped", "first_nonfinite", ...}
        - or the log's last line, ``{"end": {...}, "final_scale": float}``: the run's counts at
        its end (eval forwards and steps after the last logged one), the final loss scale."""
        if "step" not in record:
            self.final_scale = record.get("final_scale", self.final_scale)
            end = record.get("end") or {}
            self.steps = max(self.steps, end.get("steps", 0))
            self.forks = end.get("forks", self.forks)
            if "eval_forwards" in end:
                self.eval_forwards = end["eval_forwards"]["count"]
                self.eval_recorded = end["eval_forwards"]["recorded"]
            self.unmeasured = dict(end.get("unmeasured", self.unmeasured))
            return
        self._stop_rows()
        for module, phases in record["layers"].items():
            for phase, stats in phases.items():
                slot = self.layers.setdefault(module, {})
                slot[phase] = add_stats(slot.get(phase, {}), stats)
        for name, stats in record["params"].items():
            extra = {k: stats[k] for k in ("norm", "overflow_at_scale") if k in stats}
            previous = self.params.get(name, {})
            merged = add_stats({k: v for k, v in previous.items() if k not in extra},
                               {k: v for k, v in stats.items() if k not in extra})
            merged["norm"] = extra.get("norm")
            if "overflow_at_scale" in extra:
                merged["overflow_at_scale"] = previous.get("overflow_at_scale", 0) + extra["overflow_at_scale"]
            self.params[name] = merged
        self._add_record(record)

    def _add_record(self, record: dict[str, Any], matched: Matched | None = None) -> None:
        """What a step record adds beside its Stats."""
        self.steps = max(self.steps, record["step"] + 1, record.get("steps_seen", 0))
        self.logged_steps += 1
        first = record.get("first_nonfinite")
        if self.first_nonfinite is None and first:
            self.first_nonfinite = first
        elif first and first.get("op") and first.get("made_in") == "loss" and from_the_loss(self.first_nonfinite):
            self.first_nonfinite = named_later(self.first_nonfinite, first)  # the probe named it again
        for module, entry in (record.get("fp8") or {}).items():
            slot = self.fp8.setdefault(module, {"kind": entry.get("kind")})
            for operand, row in entry.items():
                if isinstance(row, dict):
                    slot[operand] = add_fp8(slot.get(operand, {}), row)
        if record.get("dtype"):  # detected at the run's first forward: every record says it
            self.dtype, self.dtype_source = record["dtype"], record.get("dtype_source")
        if "eval_forwards" in record:
            self.eval_forwards = record["eval_forwards"]
        if isinstance(record.get("forks"), int):
            self.forks = record["forks"]  # counted from the start of the run
        if record.get("unmeasured"):
            self.unmeasured = dict(record["unmeasured"])  # counted from the start of the run
        if record.get("scale") is not None:
            self.scale_steps.append(record["step"])
            self.scales.append(record["scale"])
        if record.get("skipped"):
            self.skipped.append(record["step"])
            self.nonfinite_params[record["step"]] = record.get("nonfinite_params", [])
        self.verdicts.add(record, self.dtype, matched)

    def findings(self, device: dict[str, Any] | None = None) -> list[Finding]:
        """The run's AMP6xx findings; ``device``: condition rows a Monitor kept on its device."""
        return self.verdicts.findings(self.dtype, device=device, first_nonfinite=self.first_nonfinite,
                                      source=self.source, dtype_source=self.dtype_source)

    def summary(self, device: dict[str, Any] | None = None) -> dict[str, Any]:
        self._stop_rows()
        scaler = None
        if self.scales:
            scale = self.final_scale if self.final_scale is not None else self.scales[-1]
            scaler = {"scale": scale, "used_last": self.scales[-1], "skipped_steps": list(self.skipped),
                      "history": [[step, value] for step, value in zip(self.scale_steps, self.scales, strict=True)],
                      "nonfinite_params": {str(k): v for k, v in self.nonfinite_params.items()}}
        return {"steps": self.steps, "logged_steps": self.logged_steps, "cut_short": self.cut_short,
                "dtype": self.dtype, "first_nonfinite": self.first_nonfinite,
                # sorted as the summary at exit sorts them: a record holds one optimizer's parameters
                "layers": dict(sorted(self.layers.items())), "params": dict(sorted(self.params.items())),
                "scaler": scaler,
                "unmeasured": dict(sorted(self.unmeasured.items())),
                "dtype_source": self.dtype_source or "given",
                "eval_forwards": {"count": self.eval_forwards, "recorded": self.eval_recorded},
                "forks": self.forks,
                **({"fp8": dict(sorted(self.fp8.items()))} if self.fp8 else {}),
                "findings": [f.to_dict() for f in self.findings(device)]}


def read_log(path: Path) -> SummaryBuilder:
    """Rebuild a summary from a JSON-lines log, streamed: memory stays flat however long the log."""
    header, records = open_rows(path)
    source = header.get("source")
    if not (isinstance(source, dict) and isinstance(source.get("file"), str)
            and isinstance(source.get("line"), int)):
        source = {"file": str(path), "line": 0}  # a log that does not say: the findings point at it
    builder = SummaryBuilder(header["dtype"], source=source)
    # only format 3 ends every log with its end line: a format 1 or 2 log of a run without a
    # GradScaler has none, whole or not (its final_scale line was the scaler's)
    builder.cut_short = header["ampaudit_watch"] >= 3
    names = header.get("row")
    for record, matched in records:
        if header["ampaudit_watch"] >= 2:
            builder.add_rows(record, matched, names, path)
        else:
            builder.add(record)
        if "step" not in record:  # the end line, written last at stop()
            builder.cut_short = False
    return builder
