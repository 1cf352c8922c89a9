"""The one definition of watch's rows: what a tensor's raw row holds, which Stats fields a
summary gets from it, and how each of them reduces - summed, or the largest kept - across a
step's events, across steps and across ranks.

Every user takes offsets and reductions from ``LAYOUT``: the arena (row widths), the three
row kernels (``stats`` with torch ops, ``cpu_kernel`` - whose C source is compiled with the
bin shift from here and checked against it at load - and ``triton_stats``, whose slots are
constexpr arguments), the step reducer (sums, maxima, the DDP all_gather) and
``stats_merge`` (steps added up when a log is read). Torch-free, so that ``ampaudit report``
reads a log without importing torch.

The raw row of one tensor, filled in place by a kernel (``arena.RowArena``):

- counts (int64): ``bins`` histogram counts of |x|'s top fp32 bits (8 exponent bits and 2
  mantissa bits: ``bits >> bin_shift``; bin 0 holds exact zeros only), then the count slots
  below (``COUNT_SLOTS``);
- extras (float32): the slots of ``EXTRA_SLOTS``.

As one float64 matrix (``stats.raw_matrix``) a row is its counts, then its extras.
"""

from __future__ import annotations

from dataclasses import dataclass

SUM, MAX = "sum", "max"  # how a slot or field reduces over events, steps and ranks
LAST = "last"  # an fp8 field computed once per step (a scale): across steps, the latest


@dataclass(frozen=True)
class Slot:
    """A named place in a row, or a Stats field, and how two of its values combine."""

    name: str
    reduce: str  # SUM or MAX
    doc: str
    integer: bool = True  # a count (read back as int); False: a magnitude (float)


COUNT_SLOTS = (  # after the bins, in the int64 counts row
    Slot("scaled", SUM, "|x| * loss scale beyond the audited dtype's max (parameter gradients with a GradScaler)"),
    Slot("overflow", SUM, "|x| that round to Inf in the audited dtype: |x| >= max + half an ulp (NaN not)"),
    Slot("neginf", SUM, "values that are exactly -inf"),
)
EXTRA_SLOTS = (  # the float32 extras row
    Slot("absmax", MAX, "the largest finite |x|", integer=False),
    Slot("sumsq", SUM, "the sum of squares (parameter gradients: their norm)", integer=False),
)
FIELDS = (  # a summary's Stats, in this order; "hist" (not here) follows them
    Slot("numel", SUM, "elements"),
    Slot("nan", SUM, "NaN values"),
    Slot("inf", SUM, "infinite values, +inf and -inf"),
    Slot("neginf", SUM, "values that are exactly -inf (masked attention scores, say): a part of inf"),
    Slot("overflow", SUM, "Inf, or finite values that become Inf when cast to the audited dtype"),
    Slot("underflow", SUM, "nonzero values below the audited dtype's smallest normal"),
    Slot("zero", SUM, "exact zeros"),
    Slot("absmax", MAX, "the largest finite |x|", integer=False),
)

FP8_OPERANDS = ("input", "weight", "grad_output")  # a Linear's GEMM operands, as a float8 recipe casts them
# watch(..., fp8=True): one row per (Linear, operand) and step (watch/fp8.py), in this order. No
# "saturated" for the tensorwise scale: it puts the amax at the format's max, so none saturates.
FP8_FIELDS = (
    Slot("numel", SUM, "elements"),
    Slot("underflow", SUM, "nonzero elements that round to zero after the tensorwise (current) scale"),
    Slot("delayed_saturated", SUM, "elements beyond the format's max after the delayed recipe's scale"),
    Slot("delayed_underflow", SUM, "nonzero elements that round to zero after the delayed recipe's scale"),
    Slot("amax", MAX, "the largest |x| of the step", integer=False),
    Slot("jump", MAX, "amax over the previous step's amax (0: no previous step)", integer=False),
    Slot("history_amax", MAX, "the largest amax of the previous fp8_history steps: what delayed scaling "
         "scales by (0: no history yet; the step's own amax is used)", integer=False),
    Slot("scale", LAST, "the tensorwise (current) recipe's scale: the format's max / amax", integer=False),
    Slot("delayed_scale", LAST, "the delayed recipe's scale: the format's max / history_amax", integer=False),
)
FP8_SUMS = tuple(s.name for s in FP8_FIELDS if s.reduce == SUM)  # filled per call, summed over a step's calls


class StepLayout:
    """Offsets and reductions of the raw row, the compact Stats row and a step's buffer."""

    def __init__(self, bin_shift: int = 21, count_slots: tuple[Slot, ...] = COUNT_SLOTS,
                 extra_slots: tuple[Slot, ...] = EXTRA_SLOTS, fields: tuple[Slot, ...] = FIELDS) -> None:
        # The raw row. A bin is a float's top bits: |x|'s fp32 bits >> bin_shift.
        self.bin_shift = bin_shift
        self.bins = 1 << (31 - bin_shift)  # 1024: 256 exponents x 4
        self.exponents = 256  # fp32's 8 exponent bits
        self.per_exponent = self.bins // self.exponents
        self.count_slots, self.extra_slots = count_slots, extra_slots
        self.count = {s.name: self.bins + i for i, s in enumerate(count_slots)}  # index in the counts row
        self.counts = self.bins + len(count_slots)  # the counts row's width (int64)
        self.extra = {s.name: i for i, s in enumerate(extra_slots)}  # index in the extras row
        self.extras = len(extra_slots)  # the extras row's width (float32)
        # The raw matrix: counts, then extras, as float64 columns.
        self.raw = self.counts + self.extras
        self.raw_extra = {name: self.counts + i for name, i in self.extra.items()}
        self.raw_max = tuple(self.counts + i for i, s in enumerate(extra_slots) if s.reduce == MAX)
        self.nonfinite_bins = range(self.bins - self.per_exponent, self.bins)  # exponent 255: Inf and NaN
        # The compact Stats row: the fields, then one count per fp32 exponent (the histogram).
        self.fields = tuple(f.name for f in fields)
        self.field = {f.name: i for i, f in enumerate(fields)}
        self.reduce = {f.name: f.reduce for f in fields}
        self.integer = {f.name: f.integer for f in fields}
        self.max_fields = tuple(i for i, f in enumerate(fields) if f.reduce == MAX)
        self.hist = len(fields)
        self.width = self.hist + self.exponents
        # A CPU activation or gradient over hist_sample_above elements has its histogram estimated
        # from about hist_sample of them (every count exact: cpu_stats.c; below, binning a sample
        # costs more than binning all); watch(exact_histograms=True) bins all.
        self.hist_sample, self.hist_sample_above = 2048, 16384

    def step_buffer(self, n_rows: int, n_params: int, sharded: tuple[int, ...] = ()) -> StepBuffer:
        """The flat buffer one logged step reads back, for ``n_rows`` (module, phase) rows and
        ``n_params`` parameter rows, of which those at ``sharded`` are shards (FSDP2)."""
        return StepBuffer(self, n_rows, n_params, sharded)


@dataclass(frozen=True)
class StepBuffer:
    """One logged step as a flat float64 buffer: a Stats row per (module, phase), one per
    parameter, then per parameter its gradient norm and count overflowing at the loss
    scale, then the tail - the first non-finite event's sequence number, the loss scale and
    the GradScaler's found-inf flag (-1: none).

    Across ranks: Stats fields reduce as ``StepLayout`` says; norms keep the largest (DDP's
    gradients are all-reduced: every rank has the same), except a sharded parameter's
    (FSDP2: each rank holds a shard), whose norm is the root of the sum of the ranks' squares
    (``ROOT_SUM_SQUARES``); overflow counts are summed; the
    first event is the earliest (``FIRST``), the scale rank 0's (``RANK0``) and found-inf the
    largest."""

    layout: StepLayout
    n_rows: int
    n_params: int
    sharded: tuple[int, ...] = ()  # parameters (their index) whose gradients are shards

    FIRST, RANK0, ROOT_SUM_SQUARES = "first", "rank 0", "root of the sum of squares"  # the tail's own

    @property
    def stats(self) -> slice:
        return slice(0, (self.n_rows + self.n_params) * self.layout.width)

    @property
    def norms(self) -> slice:
        start = self.stats.stop
        return slice(start, start + self.n_params)

    @property
    def scaled(self) -> slice:
        start = self.norms.stop
        return slice(start, start + self.n_params)

    @property
    def tail(self) -> slice:
        """Norms, overflow at scale, first, scale, found-inf: what the step decides with."""
        return slice(self.norms.start, self.size)

    @property
    def first(self) -> int:
        return self.scaled.stop

    @property
    def scale(self) -> int:
        return self.first + 1

    @property
    def found_inf(self) -> int:
        return self.first + 2

    @property
    def size(self) -> int:
        return self.first + 3

    def row(self, i: int) -> slice:
        """The i-th Stats row: the (module, phase) rows, then the parameters'."""
        width = self.layout.width
        return slice(i * width, (i + 1) * width)

    def reductions(self) -> list[tuple[list[int], str]]:
        """The positions that do not reduce by SUM across ranks, with how they do."""
        width, rows = self.layout.width, self.n_rows + self.n_params
        by_field = [([r * width + i for r in range(rows)], self.layout.reduce[name])
                    for name, i in self.layout.field.items() if self.layout.reduce[name] != SUM]
        shards = {self.norms.start + i for i in self.sharded}
        norms = [p for p in range(self.norms.start, self.norms.stop) if p not in shards]
        return [*by_field, (norms, MAX), (sorted(shards), self.ROOT_SUM_SQUARES), ([self.first], self.FIRST),
                ([self.scale], self.RANK0), ([self.found_inf], MAX)]


LAYOUT = StepLayout()
