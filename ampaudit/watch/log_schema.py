"""What a watch log's step record may hold (docs/watch.md, "The log"): checked line by line as
the log streams, so that a hostile or damaged log is one line naming FILE:LINE, never an error
from deep inside the summary, the plots or TensorBoard."""

from __future__ import annotations

from typing import Any

from ampaudit.watch.layout import FP8_FIELDS, FP8_OPERANDS
from ampaudit.watch.stats_merge import FIELDS

MAX_STEP = 2**53  # a step TensorBoard (int64) and JSON numbers (doubles) hold exactly
NEEDED = ("numel", "nan", "inf")  # a format-1 Stats dict without these cannot be summed
_TEXT_KEYS = ("module", "phase", "op", "note")  # of first_nonfinite: shown as text
_INT_KEYS = ("step", "rank")


MAX_INT = 2**64  # no counter a log writes reaches it; 10**400 overflowed float() deep in the summary


def _number(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return -MAX_INT <= value <= MAX_INT
    return isinstance(value, float)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def step_problem(record: dict[str, Any], version: int, names: list[str] | None, *,
                 rows_checked: bool = False) -> str | None:
    """Why ``record`` is not a step record of a format-``version`` log (``names``: the row's
    fields, format 2), or None. ``rows_checked``: its layers and params were proven right
    already (``line_shape``: the line matched its shape), the rest of it is checked here."""
    step = record.get("step")
    if not _whole(step) or not 0 <= step < MAX_STEP:
        return f"step must be a whole number from 0 to 2**53, not {str(step)[:40]}"
    if rows_checked:
        return _extras_problem(record)
    for key in ("layers", "params"):
        if not isinstance(record.get(key), dict):
            return f"{key} must be an object"
    for module, phases in record["layers"].items():
        if not isinstance(phases, dict):
            return f"layers.{module} must be an object of phases"
        for phase, stats in phases.items():
            problem = _stats_problem(stats, version, names)
            if problem:
                return f"layers.{module}.{phase}: {problem}"
    for name, stats in record["params"].items():
        problem = _stats_problem(stats, version, names)
        if problem:
            return f"params.{name}: {problem}"
    return _extras_problem(record)


def _stats_problem(stats: Any, version: int, names: list[str] | None) -> str | None:
    if version >= 2:
        if not isinstance(stats, list) or len(stats) < len(names or ()) or not all(_number(v) for v in stats):
            return "a row must be a list of numbers, one per field the header names, then histogram counts"
        return None
    if not isinstance(stats, dict):
        return "must be an object of statistics"
    missing = [f for f in NEEDED if f not in stats]
    if missing:
        return f"no {', '.join(missing)}"
    bad = [f for f in FIELDS if f in stats and not _number(stats[f])]
    if bad:
        return f"{bad[0]} must be a number"
    hist = stats.get("hist", [])
    if not isinstance(hist, list) or not all(isinstance(b, list) and len(b) == 2 and all(_number(v) for v in b)
                                             for b in hist):
        return "hist must be a list of [exponent, count] pairs"
    return None


def _extras_problem(record: dict[str, Any]) -> str | None:
    first = record.get("first_nonfinite")
    if first is not None:
        if not isinstance(first, dict):
            return "first_nonfinite must be an object or null"
        for key in _TEXT_KEYS:
            if first.get(key) is not None and not isinstance(first[key], str):
                return f"first_nonfinite.{key} must be text"
        for key in _INT_KEYS:
            if first.get(key) is not None and not _whole(first[key]):
                return f"first_nonfinite.{key} must be a whole number"
    if record.get("scale") is not None and not _number(record["scale"]):
        return "scale must be a number or null"
    if not isinstance(record.get("skipped", False), bool):
        return "skipped must be true or false"
    params = record.get("nonfinite_params", [])
    if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
        return "nonfinite_params must be a list of names"
    return _fp8_problem(record.get("fp8"))


def _fp8_problem(fp8: Any) -> str | None:
    """``fp8=True``'s rows: {module: {"kind": text, operand: {"format": text, field: number}}}."""
    if fp8 is None:
        return None
    if not isinstance(fp8, dict):
        return "fp8 must be an object of modules"
    for module, entry in fp8.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("kind", ""), str):
            return f"fp8.{module} must be an object with a kind (text) and a row per operand"
        for operand, row in entry.items():
            if operand == "kind":
                continue
            if operand not in FP8_OPERANDS or not isinstance(row, dict):
                return f"fp8.{module}.{operand}: not an operand ({', '.join(FP8_OPERANDS)}) with a row"
            if not isinstance(row.get("format", ""), str):
                return f"fp8.{module}.{operand}.format must be text"
            bad = [f.name for f in FP8_FIELDS if f.name in row and not _number(row[f.name])]
            if bad or not _number(row.get("numel")):
                return f"fp8.{module}.{operand}.{(bad or ['numel'])[0]} must be a number"
    return None


def end_problem(record: dict[str, Any]) -> str | None:
    """Why ``record`` is not a log's last line (format 3: ``{"end": {...}}``, with
    ``final_scale`` when a GradScaler ran; format 2: ``{"final_scale": N}`` alone), or None."""
    if set(record) - {"end", "final_scale"}:
        return "not a step record (needs step, layers and params) nor the log's end"
    if "final_scale" in record and not _number(record["final_scale"]):
        return "final_scale must be a number"
    end = record.get("end", {})
    if not isinstance(end, dict):
        return "end must be an object"
    for key in ("steps", "forks"):
        if key in end and not (_whole(end[key]) and 0 <= end[key] <= MAX_STEP):
            return f"end.{key} must be a whole number"
    evals = end.get("eval_forwards", {"count": 0, "recorded": False})
    if not (isinstance(evals, dict) and _whole(evals.get("count")) and isinstance(evals.get("recorded"), bool)):
        return "end.eval_forwards must be {count: whole number, recorded: true or false}"
    unmeasured = end.get("unmeasured", {})
    if not (isinstance(unmeasured, dict) and all(_whole(n) for n in unmeasured.values())):
        return "end.unmeasured must map kinds to whole numbers"
    return None
