"""Per-tensor statistics without host syncs, in as few passes as the hardware allows.

Each tensor becomes one *raw row* (``layout``, ``arena``): 1024 counts of ``|x|``'s top
float bits (8 exponent bits and the 2 leading mantissa bits: one shift), how many |x| round
to Inf in the audited dtype (|x| >= max + half an ulp: 65520 for float16 - finer than the
bins), how many values are -inf, and the finite absmax. Bin 0 holds exact zeros only (fp32
subnormals too small to reach bin 1 are moved there). The histogram gives the rest: zeros
and underflow (the low exponents), Inf (exponent 255, mantissa 0), NaN (exponent 255 with
the quiet bit - every NaN an operation produces) and the log2-magnitude histogram.
On CUDA one Triton kernel builds the row (``triton_stats``), on the CPU one C kernel
(``cpu_kernel``, compiled on first use); without them a handful of torch passes do. Rows
are reduced to the summary's Stats in one batched step at the step boundary
(``compact``), right before the one host sync. Every offset comes from ``layout.LAYOUT``.
"""

from __future__ import annotations

import sys
from itertools import compress

import torch

from ampaudit.core.dtypes import LowDtype
from ampaudit.watch import cpu_kernel
from ampaudit.watch.layout import LAYOUT
from ampaudit.watch.stats_merge import FIELDS

BINS = LAYOUT.bins
RAW = LAYOUT.raw  # the raw matrix: counts, then extras
HIST = LAYOUT.hist  # compact rows: the fields above, then 256 exponent counts
WIDTH = LAYOUT.width
_SCALED, _OVERFLOW, _NEGINF = (LAYOUT.count[k] for k in ("scaled", "overflow", "neginf"))
_ABSMAX, _SUMSQ = LAYOUT.extra["absmax"], LAYOUT.extra["sumsq"]


PLAIN = (torch.Tensor, torch.nn.Parameter)  # what the kernels read; a subclass may have no plain storage


def is_dtensor(t: torch.Tensor) -> bool:
    """A torch.distributed DTensor (read by name: importing torch.distributed.tensor is slow)."""
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def fill_row(x: torch.Tensor, counts: torch.Tensor, extras: torch.Tensor, limits: LowDtype, *, norm: bool = False,
             scale: torch.Tensor | None = None) -> None:
    """Add ``x``'s statistics to a zeroed arena row (``arena.RowArena``), on x's device, with
    no host sync: the bin counts, how many |x| round to Inf in the audited dtype, how many
    values are -inf, and the finite absmax; with ``norm``, the sum of squares; with ``scale``
    (a device scalar), how many |x| * scale exceed the dtype's max."""
    if is_dtensor(x):  # a shard per rank (FSDP2, tensor parallel): this rank's part
        x = x.to_local()
    if type(x) in PLAIN and x.is_cpu and cpu_kernel.available():  # a hook's hot path first
        cpu_kernel.fill_row(x, counts, extras, limits.overflow_at, norm=norm)  # the norm in the same pass
        fill_param_extras(x, counts, extras, limits, norm=False, scale=scale)
        return
    if type(x) not in PLAIN:
        torch_fill_row(x, counts, extras, limits)
        fill_param_extras(x, counts, extras, limits, norm=norm, scale=scale)
        return
    if x.device.type == "cuda":
        from ampaudit.watch import triton_stats

        if triton_stats.available():
            if x.dtype == torch.float64:  # the kernel loads it as float32: Inf where fp32 ends
                x = cpu_kernel.as_float32(x)
            triton_stats.fill_row(x, counts, extras, limits.overflow_at, norm=norm, scale=scale, limit=limits.max)
            return
    torch_fill_row(x, counts, extras, limits)
    fill_param_extras(x, counts, extras, limits, norm=norm, scale=scale)


def fill_sampled_row(x: torch.Tensor, counts: torch.Tensor, extras: torch.Tensor, limits: LowDtype) -> None:
    """``fill_row`` for a module's output or gradient: on the CPU kernel a tensor over
    ``LAYOUT.hist_sample_above`` elements has its magnitude histogram estimated from about
    ``LAYOUT.hist_sample`` (``cpu_kernel.fill_sampled_row``), every count exact - zeros,
    underflow, overflow, NaN, Inf, -inf, the finite absmax; elsewhere the whole row."""
    if type(x) in PLAIN and x.is_cpu and cpu_kernel.available():
        cpu_kernel.fill_sampled_row(x, counts, extras, limits.overflow_at, limits.normal_exponent)
    else:
        fill_row(x, counts, extras, limits)


def fill_nonfinite(x: torch.Tensor, counts: torch.Tensor, extras: torch.Tensor, limits: LowDtype) -> None:
    """What ``nonfinite`` and ``harmful`` read of a row (its NaN, Inf and -inf counts), for a
    tensor that is in no statistics, only a candidate first non-finite: on the CPU a cheaper
    pass than ``fill_row`` (``cpu_kernel.fill_nonfinite``), elsewhere the whole row."""
    if type(x) in PLAIN and x.is_cpu and cpu_kernel.available():
        cpu_kernel.fill_nonfinite(x, counts)
    else:
        fill_row(x, counts, extras, limits)


def fill_param_extras(x: torch.Tensor, counts: torch.Tensor, extras: torch.Tensor, limits: LowDtype, *,
                      norm: bool, scale: torch.Tensor | None) -> None:
    """The sum of squares and the count over the loss scale, with torch ops: parameter
    gradients only, where they are cheap enough (the Triton kernel fuses them)."""
    if not (norm or scale is not None):
        return
    flat = x.detach().reshape(-1).float()
    if norm:
        extras[_SUMSQ] = torch.dot(flat, flat)
    if scale is not None:
        counts[_SCALED] = (flat.abs() * scale.to(flat.device, torch.float32) > limits.max).sum()


def new_row(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed row outside any arena: (counts, extras)."""
    return (torch.zeros(LAYOUT.counts, dtype=torch.int64, device=device),
            torch.zeros(LAYOUT.extras, dtype=torch.float32, device=device))  # whatever the default dtype


def tensor_stats(x: torch.Tensor, limits: LowDtype, fill=fill_row) -> dict:
    """The summary's Stats of one tensor, read back (a host sync): for tools and tests.
    ``fill`` picks the backend (default: the one for x's device)."""
    counts, extras = new_row(x.device)
    fill(x, counts, extras, limits)
    raw = raw_matrix(counts[None], extras[None]).cpu()
    return to_stats(compact(raw, limits)[0].tolist())


def _signed_bins(x: torch.Tensor) -> torch.Tensor:
    """Each fp32 in ``x`` as its bin (``LAYOUT.bin_shift``), with its sign bit above it: |x|'s
    bin for x >= 0, ``BINS`` + |x|'s bin for x < 0."""
    if sys.byteorder == "little" and LAYOUT.bin_shift >= 16:  # the high half-word of each float, read in place
        top = x.view(torch.int16)[1::2] >> (LAYOUT.bin_shift - 16)
    else:
        top = x.view(torch.int32) >> LAYOUT.bin_shift
    return top.bitwise_and_(2 * BINS - 1)  # the arithmetic shift's sign bits cleared


def torch_fill_row(x: torch.Tensor, counts: torch.Tensor, extras: torch.Tensor, limits: LowDtype) -> None:
    """``fill_row`` with torch ops: the path without a kernel."""
    # contiguous: an expanded gradient (sum()'s, stride 0) cannot be viewed as half-words
    x = cpu_kernel.as_float32(x.reshape(-1)).contiguous()
    keys = _signed_bins(x)  # signed: -inf is the negative half's Inf bin, at no extra pass
    if x.device.type == "cpu":
        signed = torch.bincount(keys, minlength=2 * BINS)
    else:  # bincount sizes its output from the data's max: a host sync on a GPU
        ones = torch.ones((), dtype=torch.int64, device=x.device).expand(keys.numel())
        signed = torch.zeros(2 * BINS, dtype=torch.int64, device=x.device).scatter_add_(0, keys.long(), ones)
    row = signed.view(2, BINS).sum(0)
    a = x.abs()  # a new tensor: modified in place below, never x
    zeros = a.numel() - torch.count_nonzero(a)
    row[1] += row[0] - zeros  # subnormals below 2**-128 share bin 0 with the zeros
    row[0] = zeros
    counts[:BINS] += row
    counts[_NEGINF] += signed[BINS + LAYOUT.nonfinite_bins.start]  # -inf: sign, exponent 255, mantissa 0
    counts[_OVERFLOW] += (a >= limits.overflow_at).sum()  # NaN compares False
    if a.numel():
        extras[_ABSMAX] = a.nan_to_num_(nan=0.0, posinf=0.0).amax()


def raw_matrix(counts: torch.Tensor, extras: torch.Tensor) -> torch.Tensor:
    """Arena rows (``RowArena.matrix``) as the N x RAW float64 matrix ``compact`` reads:
    the counts row, then the extras (``LAYOUT.raw_extra``)."""
    return torch.cat([counts.to(torch.float64), extras.to(torch.float64)], dim=1)


def compact(raw: torch.Tensor, limits: LowDtype) -> torch.Tensor:
    """Raw rows (N x RAW) to Stats rows (N x WIDTH): all tensors of a step at once."""
    return _compact(raw, raw[:, LAYOUT.raw_extra["absmax"]], limits)


def compact_rows(counts: torch.Tensor, extras: torch.Tensor, limits: LowDtype) -> torch.Tensor:
    """``compact(raw_matrix(counts, extras))`` from the arena's rows as they are: the bins
    summed into exponents in int64 (exact) before anything becomes float64 - a quarter of
    the float64 work, and no float64 copy of every bin. CPU rows: one C loop
    (``cpu_kernel.compact``), the same rows."""
    if counts.device.type == "cpu" and cpu_kernel.available():
        rows = cpu_kernel.compact(counts, extras, limits.normal_exponent)
        if rows is not None:
            return rows
    return _compact(counts, extras[:, _ABSMAX], limits)


def _compact(raw: torch.Tensor, absmax: torch.Tensor, limits: LowDtype) -> torch.Tensor:
    """Stats rows (float64) from rows whose first columns are a counts row (int64 or float64;
    integer counts below 2**53 either way, so the two give the same rows) and their absmax."""
    counts = raw[:, :BINS].reshape(-1, LAYOUT.exponents, LAYOUT.per_exponent)
    hist = counts.sum(-1)
    zero = counts[:, 0, 0]
    hist[:, 0] -= zero  # exponent 0 without the zeros: the fp32 subnormals
    columns = {
        "numel": counts.sum((1, 2)),
        "nan": counts[:, -1, 1:].sum(1),  # exponent 255 with mantissa bits
        "inf": counts[:, -1, 0],
        "neginf": raw[:, _NEGINF],
        "overflow": raw[:, _OVERFLOW],
        "underflow": hist[:, :limits.normal_exponent].sum(1),
        "zero": zero,
        "absmax": absmax,
    }
    f64 = torch.float64
    return torch.cat([torch.stack([columns[name].to(f64) for name in FIELDS], dim=1), hist.to(f64)], dim=1)


def nonfinite(raw: torch.Tensor) -> torch.Tensor:
    """Per raw row: whether the tensor held NaN or Inf (exponent 255)."""
    bins = LAYOUT.nonfinite_bins
    return raw[:, bins.start:bins.stop].sum(1) > 0


def harmful(raw: torch.Tensor) -> torch.Tensor:
    """Per raw row: whether the tensor held NaN or +inf. A tensor whose only non-finite values
    are -inf is a mask (``masked_fill(~mask, -inf)`` attention scores): not where a NaN is born."""
    bins = LAYOUT.nonfinite_bins
    return raw[:, bins.start:bins.stop].sum(1) - raw[:, _NEGINF] > 0


def to_stats(row: list[float]) -> dict:
    """A compact row read back on the host, as the summary's Stats: counts, absmax, and the
    histogram as [floor(log2 |x|), count] pairs for the finite nonzero values seen (-127:
    the fp32 subnormals, all below 2**-126)."""
    stats = {name: (int(row[i]) if LAYOUT.integer[name] else float(row[i])) for i, name in enumerate(FIELDS)}
    hist = row[HIST:HIST + LAYOUT.exponents - 1]  # exponent 255 (Inf/NaN) is not a magnitude
    stats["hist"] = [[e - 127, int(hist[e])] for e in compress(range(len(hist)), hist)]  # the nonzero ones, in C
    return stats
