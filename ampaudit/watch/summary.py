"""The run summary, built from per-step records - the same whether the records come live from
a Monitor or from a log file (``ampaudit report``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ampaudit.core.errors import UsageError
from ampaudit.watch.stats import add_stats


class SummaryBuilder:
    """``keep_records``: also keep every step's record (for plots from a log); a live
    monitor keeps only the running totals, so its memory stays flat however long it runs."""

    def __init__(self, dtype: str, *, keep_records: bool = False) -> None:
        self.dtype = dtype
        self.keep_records = keep_records
        self.steps = 0
        self.first_nonfinite: dict[str, Any] | None = None
        self.layers: dict[str, dict[str, dict]] = {}
        self.params: dict[str, dict] = {}
        self.scales: list[list[float]] = []
        self.skipped: list[int] = []
        self.nonfinite_params: dict[int, list[str]] = {}
        self.records: list[dict[str, Any]] = []

    def add(self, record: dict[str, Any]) -> None:
        """One logged step: {"step", "layers", "params", "scale", "skipped", "first_nonfinite", ...}."""
        if self.keep_records:
            self.records.append(record)
        self.steps = max(self.steps, record["step"] + 1, record.get("steps_seen", 0))
        if self.first_nonfinite is None and record.get("first_nonfinite"):
            self.first_nonfinite = record["first_nonfinite"]
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
        if record.get("scale") is not None:
            self.scales.append([record["step"], record["scale"]])
        if record.get("skipped"):
            self.skipped.append(record["step"])
            self.nonfinite_params[record["step"]] = record.get("nonfinite_params", [])

    def summary(self) -> dict[str, Any]:
        scaler = None
        if self.scales:
            scaler = {"scale": self.scales[-1][1], "skipped_steps": list(self.skipped), "history": self.scales,
                      "nonfinite_params": {str(k): v for k, v in self.nonfinite_params.items()}}
        return {"steps": self.steps, "dtype": self.dtype, "first_nonfinite": self.first_nonfinite,
                "layers": self.layers, "params": self.params, "scaler": scaler}


def read_log(path: Path) -> SummaryBuilder:
    """Rebuild a summary from a JSON-lines log; a crash mid-write leaves a last partial line,
    which is skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    header, builder = None, None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # the step being written when the run died
            raise UsageError(f"{path}:{number}: not a JSON line") from None
        if header is None:
            if record.get("ampaudit_watch") != 1:
                raise UsageError(f"{path} is not an ampaudit watch log (first line has no ampaudit_watch header)")
            header, builder = record, SummaryBuilder(record["dtype"], keep_records=True)
            continue
        builder.add(record)
    if builder is None:
        raise UsageError(f"{path} is empty")
    return builder
