"""The summary's per-tensor Stats: their fields, and how the Stats of two steps add up - each
field as ``layout.LAYOUT`` says (summed, or the largest kept).

Torch-free, so that ``ampaudit report`` reads a log without importing torch. A field a log
predates (``neginf``, say) reads as 0.
"""

from __future__ import annotations

from ampaudit.watch.layout import FP8_FIELDS, LAYOUT, MAX, SUM

FIELDS = LAYOUT.fields


def add_stats(total: dict, more: dict) -> dict:
    """``more`` added into ``total`` (returned; a new dict when ``total`` is empty). Fields
    missing from either (a log written before they existed) count as 0."""
    if not total:
        total = {key: more.get(key, 0) for key in FIELDS}
        total.update((k, list(map(list, v)) if k == "hist" else v) for k, v in more.items() if k not in total)
        return total
    for key in FIELDS:
        if LAYOUT.reduce[key] == MAX:
            total[key] = max(total.get(key, 0), more.get(key, 0))
        else:
            total[key] = total.get(key, 0) + more.get(key, 0)
    hist = dict(map(tuple, total["hist"]))
    for exponent, count in more["hist"]:
        hist[exponent] = hist.get(exponent, 0) + count
    total["hist"] = [[e, c] for e, c in sorted(hist.items())]
    return total


# A log line (format 2) holds each Stats as one flat list, the cheapest form to write every
# step: the fields (``LOG_ROW``, named in the log's header), then the histogram as a dense
# run of counts from exponent ``hist_from`` (zeros inside the run kept, none outside it).
LOG_ROW = (*FIELDS, "hist_from")


def stats_from_row(row: list, names: list[str]) -> dict:
    """A log row (``LOG_ROW``, its fields as the log's header ``names`` them) as the Stats
    dict the summary adds up; a field the log predates reads as 0."""
    n = len(names)
    stats = dict.fromkeys(FIELDS, 0)
    stats.update(zip(names, row[:n], strict=True))
    start = stats.pop("hist_from")
    stats["hist"] = [[start + i, count] for i, count in enumerate(row[n:]) if count]
    return stats


def add_fp8(total: dict, more: dict) -> dict:
    """An fp8 row (``layout.FP8_FIELDS``) of one more step added into ``total`` (returned):
    counts summed, amax and jump the largest, scales and the history's amax the latest; the
    steps counted. A field missing from a row counts as 0."""
    total = dict(total) if total else {"format": more.get("format"), "steps": 0}
    total["steps"] += 1
    for f in FP8_FIELDS:
        value = more.get(f.name, 0)
        if f.reduce == SUM:
            total[f.name] = total.get(f.name, 0) + value
        elif f.reduce == MAX:
            total[f.name] = max(total.get(f.name, 0), value)
        else:
            total[f.name] = value
    return total
