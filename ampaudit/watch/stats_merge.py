"""The summary's per-tensor Stats: their fields, and how the Stats of two steps add up.

Torch-free, so that ``ampaudit report`` reads a log without importing torch.
"""

from __future__ import annotations

FIELDS = ("numel", "nan", "inf", "overflow", "underflow", "zero", "absmax")


def add_stats(total: dict, more: dict) -> dict:
    """``more`` added into ``total`` (returned; a new dict when ``total`` is empty)."""
    if not total:
        return {k: (list(map(list, v)) if k == "hist" else v) for k, v in more.items()}
    for key in FIELDS:
        total[key] = max(total[key], more[key]) if key == "absmax" else total[key] + more[key]
    hist = dict(map(tuple, total["hist"]))
    for exponent, count in more["hist"]:
        hist[exponent] = hist.get(exponent, 0) + count
    total["hist"] = [[e, c] for e, c in sorted(hist.items())]
    return total
