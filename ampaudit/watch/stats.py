"""Per-tensor statistics, accumulated on the device: one row of numbers per tensor.

A row holds NaN, Inf, overflow (Inf or finite beyond the audited dtype's max), underflow
(nonzero below its smallest normal), zero and element counts, the finite absmax, and a
256-bin histogram of fp32 exponents (log2 magnitudes). The exponents come from the float
bits in one pass, which also yields zero and underflow counts, so a tensor costs a handful
of fused passes (one Triton kernel on CUDA, see ``triton_stats``) and no host sync.
"""

from __future__ import annotations

import math

import torch

# Row layout: counts first (summed), then absmax (max-reduced), then the exponent histogram.
NUMEL, NAN, INF, OVERFLOW, UNDERFLOW, ZERO, ABSMAX = range(7)
HIST = 7
BINS = 256
WIDTH = HIST + BINS
FIELDS = ("numel", "nan", "inf", "overflow", "underflow", "zero", "absmax")


class Limits:
    """Where the audited dtype's limits fall: its max and its smallest normal's exponent bin."""

    def __init__(self, dtype: torch.dtype) -> None:
        info = torch.finfo(dtype)
        self.dtype = dtype
        self.max = info.max
        self.normal_bin = math.frexp(info.smallest_normal)[1] - 1 + 127  # bins below: underflow (and zero: bin 0)


def tensor_row(x: torch.Tensor, limits: Limits) -> torch.Tensor:
    """One statistics row for ``x``, on x's device (no host sync)."""
    if x.device.type == "cuda":
        from ampaudit.watch import triton_stats

        if triton_stats.available():
            return triton_stats.row(x, limits)
    return torch_row(x, limits)


def torch_row(x: torch.Tensor, limits: Limits) -> torch.Tensor:
    a = x.detach().float().abs().reshape(-1)
    bins = torch.bincount(a.view(torch.int32) >> 23, minlength=BINS).to(torch.float64)
    nan = torch.isnan(a).sum()
    head = torch.stack([
        torch.tensor(float(a.numel()), dtype=torch.float64, device=a.device),
        nan.to(torch.float64),
        bins[255] - nan,  # exponent 255 holds both
        (a > limits.max).sum().to(torch.float64),  # inf counts: it is beyond the max too
        bins[1:limits.normal_bin].sum(),
        bins[0],  # zero (and fp32 subnormals, which every low dtype flushes anyway)
        torch.nan_to_num(a, nan=0.0, posinf=0.0).amax().to(torch.float64) if a.numel() else
        torch.zeros((), dtype=torch.float64, device=a.device),
    ])
    return torch.cat([head, bins])


def merge(into: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """Sum the counts and the histogram, keep the larger absmax."""
    merged = into + row
    merged[ABSMAX] = torch.maximum(into[ABSMAX], row[ABSMAX])
    return merged


def nonfinite(row: torch.Tensor) -> torch.Tensor:
    return (row[NAN] + row[INF]) > 0


def to_stats(row: list[float]) -> dict:
    """A row read back on the host, as the summary's Stats: counts, absmax, and the
    histogram as [log2 magnitude, count] pairs for the exponents seen (zeros excluded)."""
    stats = {name: (float(row[i]) if name == "absmax" else int(row[i])) for i, name in enumerate(FIELDS)}
    hist = row[HIST:]
    stats["hist"] = [[e - 127, int(c)] for e, c in enumerate(hist) if c and 0 < e < 255]
    return stats


def add_stats(total: dict, more: dict) -> dict:
    if not total:
        return {k: (list(map(list, v)) if k == "hist" else v) for k, v in more.items()}
    for key in FIELDS:
        total[key] = max(total[key], more[key]) if key == "absmax" else total[key] + more[key]
    hist = dict(map(tuple, total["hist"]))
    for exponent, count in more["hist"]:
        hist[exponent] = hist.get(exponent, 0) + count
    total["hist"] = [[e, c] for e, c in sorted(hist.items())]
    return total
