"""The raw statistics row on the CPU in one fused pass (``cpu_stats.c``), built on first use.

torch's CPU ops need six passes and a serial bincount for a row; the C kernel reads each
element once, on torch's thread pool. At a logged step's boundary the same library turns the
step's rows into Stats rows (``compact``) and into the step's buffer (``step_buffer``), each
one C loop where the torch ops would be tens of small ops. ``core.native`` compiles it on first
use, once per machine. Without a compiler, or with ``AMPAUDIT_CPU_KERNEL=0``, ``available()``
is False and ``stats`` uses the torch ops; ``status()`` says why.

The row's layout is ``layout.LAYOUT``'s: the C source is compiled with its bin shift
(``-DAMPAUDIT_BIN_SHIFT``), the library's ``ampaudit_bins()`` is checked against it at load,
and each call passes a pointer to each slot of the row.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from ampaudit.core import native
from ampaudit.core.tensors import dense_numel
from ampaudit.watch.layout import LAYOUT
from ampaudit.watch.rule_api import COLUMNS

SOURCE = Path(__file__).with_name("cpu_stats.c")
DEFINES = [f"-DAMPAUDIT_BIN_SHIFT={LAYOUT.bin_shift}"]  # the layout's constants the source needs
_ENTRY = {torch.float32: "ampaudit_rows_f32", torch.float16: "ampaudit_rows_f16", torch.bfloat16: "ampaudit_rows_bf16"}
_SAMPLED_ENTRY = {dtype: name.replace("_rows_", "_sampled_") for dtype, name in _ENTRY.items()}
_NONFINITE_ENTRY = {torch.float32: "ampaudit_nonfinite_f32", torch.float16: "ampaudit_nonfinite_f16",
                    torch.bfloat16: "ampaudit_nonfinite_bf16"}
_status = "not built yet"
_OVERFLOW, _NEGINF = LAYOUT.count["overflow"], LAYOUT.count["neginf"]
_ABSMAX, _SUMSQ = LAYOUT.extra["absmax"], LAYOUT.extra["sumsq"]
# the slots' byte offsets in a row: the kernels read int64 counts and float32 extras
_OVERFLOW_AT, _NEGINF_AT, _ABSMAX_AT, _SUMSQ_AT = _OVERFLOW * 8, _NEGINF * 8, _ABSMAX * 4, _SUMSQ * 4


@dataclass(frozen=True)
class _Library:
    rows: dict[torch.dtype, ctypes._CFuncPtr]  # the whole row
    sampled: dict[torch.dtype, ctypes._CFuncPtr]  # the whole row, its histogram estimated from a sample
    nonfinite: dict[torch.dtype, ctypes._CFuncPtr]  # the NaN and Inf bins and the -inf slot only
    compact: ctypes._CFuncPtr  # raw rows to Stats rows
    step_buffer: ctypes._CFuncPtr  # a logged step's buffer from its Stats rows
    update_rows: ctypes._CFuncPtr  # the verdicts' state rows, updated by logged steps
    param_rows: ctypes._CFuncPtr  # the parameter gradients' rows, all in one call


# where ampaudit_compact writes each Stats field, in its own order (layout.FIELDS' names)
_COMPACT_FIELDS = ("numel", "nan", "inf", "neginf", "overflow", "underflow", "zero", "absmax")


def status() -> str:
    """Which CPU path rows take, and why: "C kernel (OpenMP)", or the reason it is not used."""
    available()
    return _status


cache_dir = native.cache_dir


def _cached() -> Path:
    """Where a build of this source for this machine lives (found without a compiler)."""
    return native.cached(SOURCE, DEFINES)


@cache
def _library() -> _Library | None:
    global _status
    if native.disabled():
        _status = f"torch ops ({native.DISABLE}=0)"
        return None
    try:
        lib = ctypes.CDLL(str(native.build(SOURCE, DEFINES)))
    except OSError as exc:
        _status = f"torch ops ({exc})"
        return None
    if lib.ampaudit_bins() != LAYOUT.bins:
        _status = f"torch ops ({SOURCE.name} has {lib.ampaudit_bins()} bins, the layout {LAYOUT.bins})"
        return None
    rows = {dtype: getattr(lib, name) for dtype, name in _ENTRY.items()}
    for fn in rows.values():  # x, n, bins, overflow, neginf, absmax bits, threshold bits, sumsq or NULL, threads
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int]
        fn.restype = None
    sampled = {dtype: getattr(lib, name) for dtype, name in _SAMPLED_ENTRY.items()}
    for fn in sampled.values():  # x, n, bins, overflow, neginf, absmax bits, threshold bits, low bits, stride, threads
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_int]
        fn.restype = None
    nonfinite = {dtype: getattr(lib, name) for dtype, name in _NONFINITE_ENTRY.items()}
    for fn in nonfinite.values():  # x, n, bins, neginf
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = None
    compact = lib.ampaudit_compact  # counts, stride, absmax, stride, n, slots, normal exponent, out, width, ...
    compact.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                        ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64,
                        ctypes.c_void_p, ctypes.c_int32]
    compact.restype = None
    buffer = lib.ampaudit_step_buffer
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    buffer.argtypes = [p, i64, p, p, p, i64, i64, p, i64, p, i64, i32, i32, p, i64, p, i32, i32, i32, i32,
                       ctypes.c_double, p]
    buffer.restype = None
    update = lib.ampaudit_update_rows  # rows, n, ncols, columns, steps, k, prev, cond, value, total
    update.argtypes = [p, i64, i64, p, p, i64, i64, p, p, p]
    update.restype = None
    params = lib.ampaudit_param_rows  # count, x[], n[], dtype[], counts[], extras[], 5 slots, over, scale, max, threads
    params.argtypes = [i64, p, p, p, p, p, i32, i32, i32, i32, i32, ctypes.c_uint32, ctypes.c_float, ctypes.c_float,
                       ctypes.c_int]
    params.restype = None
    lib.ampaudit_init()
    _status = "C kernel (OpenMP)" if lib.ampaudit_openmp() else "C kernel (one thread)"
    return _Library(rows, sampled, nonfinite, compact, buffer, update, params)


def available() -> bool:
    return _library() is not None


def dense(x: torch.Tensor) -> bool:
    """Whether ``x``'s elements fill one block of memory, each once, in some order (contiguous,
    channels_last, a transpose): a row's counts do not depend on the order, so the kernels read
    such a tensor where it lies, without a copy."""
    return x.is_contiguous() or dense_numel(x.shape, x.stride()) is not None


def as_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float64, an integer dtype) as float32 with every value in its class: a finite
    float64 past fp32's range becomes fp32's max, not Inf (a finite run would have a first
    non-finite value and AMP605), a nonzero one below it the smallest subnormal, not zero."""
    x = x.detach()
    if x.dtype == torch.float64:
        a = x.abs()
        fp32 = torch.finfo(torch.float32)
        x = torch.where((a > 0) & a.isfinite(), a.clamp(fp32.smallest_normal * 2.0**-23, fp32.max).copysign(x), x)
    return x.float()


def _readable(x: torch.Tensor, *, any_order: bool = True) -> torch.Tensor:
    """``x`` as memory of a dtype the kernel reads (a copy only where it must be): dense, or with
    ``any_order=False`` (a sum of squares, whose last bits depend on the order) contiguous."""
    if x.dtype not in _ENTRY:
        x = as_float32(x)
    return x if (dense(x) if any_order else x.is_contiguous()) else x.contiguous()


def fill_row(x: torch.Tensor, counts: torch.Tensor, extras: torch.Tensor, overflow_at: float, *,
             norm: bool = False) -> None:
    """In one pass over a CPU tensor: add its bin counts to the row's bins, how many |x| >=
    overflow_at to its overflow slot and how many x are -inf to its neginf slot (int64), and
    raise its absmax extra (float32, >= 0) to the finite absmax; with ``norm``, add the sum of
    its squares to the sumsq extra (summed in fp64)."""
    entry = _library().rows.get(x.dtype)  # a hook's hot path: no copy and no lookup it can skip
    if entry is None or not (x.is_contiguous() or (not norm and dense(x))):
        x = _readable(x, any_order=not norm)
        entry = _library().rows[x.dtype]
    base, extra = counts.data_ptr(), extras.data_ptr()
    entry(x.data_ptr(), x.numel(), base, base + _OVERFLOW_AT, base + _NEGINF_AT, extra + _ABSMAX_AT,
          native.float_bits(overflow_at), extra + _SUMSQ_AT if norm else None, torch.get_num_threads())


def sample_stride(n: int) -> int:
    """One element in how many a sampled row bins: 1 (all) up to ``LAYOUT.hist_sample_above``
    elements - below that binning a sample costs more than binning them all -, above it about
    ``LAYOUT.hist_sample`` of them."""
    return n // LAYOUT.hist_sample if n > LAYOUT.hist_sample_above else 1


def fill_sampled_row(x: torch.Tensor, counts: torch.Tensor, extras: torch.Tensor, overflow_at: float,
                     normal_exponent: int) -> None:
    """``fill_row`` with the magnitude histogram estimated from about ``LAYOUT.hist_sample``
    elements (``sample_stride``), at a fraction of the cost, and every count exact: the zeros,
    the values below fp32 exponent ``normal_exponent`` (underflow), Inf, NaN, -inf, overflow,
    the finite absmax, and so each histogram class's total. A small tensor is binned whole."""
    if not fill_sampled_at(x, counts.data_ptr(), extras.data_ptr(), native.float_bits(overflow_at),
                           normal_exponent << 23):
        fill_row(x, counts, extras, overflow_at)


def fill_sampled_at(x: torch.Tensor, counts_at: int, extras_at: int, overflow_bits: int, low_bits: int) -> bool:
    """``fill_sampled_row`` into the row at these addresses (``arena.RowArena.take_cpu``), the
    thresholds as fp32 bits (``native.float_bits(overflow_at)``, ``normal_exponent << 23``).
    False, nothing written, where ``x`` is not dense or of a dtype the kernel reads: the
    caller copies (``fill_row``). A hook's hot path: no call it can skip."""
    n = x.numel()
    stride = sample_stride(n)
    library = _library()
    entry = (library.sampled if stride > 1 else library.rows).get(x.dtype)
    if entry is None or not (x.is_contiguous() or dense(x)):
        return False
    if stride > 1:
        entry(x.data_ptr(), n, counts_at, counts_at + _OVERFLOW_AT, counts_at + _NEGINF_AT, extras_at + _ABSMAX_AT,
              overflow_bits, low_bits, stride, torch.get_num_threads())
    else:
        entry(x.data_ptr(), n, counts_at, counts_at + _OVERFLOW_AT, counts_at + _NEGINF_AT, extras_at + _ABSMAX_AT,
              overflow_bits, None, torch.get_num_threads())
    return True


_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_SCALED = LAYOUT.count["scaled"]


def fill_param_rows(grads: list[torch.Tensor], rows: list[tuple[int, int]], overflow_at: float,
                    scale: float | None, limit: float) -> None:
    """``fill_row(grad, counts, extras, overflow_at, norm=True)`` for each CPU gradient into the
    arena row at its (counts, extras) addresses (``arena.RowArena.take_cpu``), in one C call (a
    step boundary's parameter rows: tens of small tensors, where a call each costs more than
    their elements), and with ``scale`` each one's count of |x| * scale > ``limit`` in float32,
    as ``stats.fill_param_extras`` computes it with torch ops."""
    k = len(grads)
    if not k:
        return
    readable = [g if g.dtype in _ENTRY and g.is_contiguous() else _readable(g, any_order=False) for g in grads]
    pointers = ctypes.c_void_p * k
    _library().param_rows(
        k, pointers(*[g.data_ptr() for g in readable]), (ctypes.c_int64 * k)(*[g.numel() for g in readable]),
        (ctypes.c_int32 * k)(*[_DTYPE_CODE[g.dtype] for g in readable]), pointers(*[c for c, _ in rows]),
        pointers(*[e for _, e in rows]), _OVERFLOW, _NEGINF, _SCALED, _ABSMAX, _SUMSQ,
        native.float_bits(overflow_at), scale if scale is not None else 0.0, limit, torch.get_num_threads())


def fill_nonfinite(x: torch.Tensor, counts: torch.Tensor) -> None:
    """Add to a row only how many values of a CPU tensor are NaN (to the NaN bin), +-inf (the
    Inf bin) and -inf (the neginf slot): what ``stats.nonfinite`` and ``stats.harmful`` read."""
    x = _readable(x)
    base, size = counts.data_ptr(), counts.element_size()
    _library().nonfinite[x.dtype](x.data_ptr(), x.numel(), base, base + _NEGINF * size)


_FIELD_AT = (ctypes.c_int32 * len(_COMPACT_FIELDS))(*(LAYOUT.field[name] for name in _COMPACT_FIELDS)) \
    if sorted(_COMPACT_FIELDS) == sorted(LAYOUT.fields) else None  # a layout with other fields: torch ops


def compact(counts: torch.Tensor, extras: torch.Tensor, normal_exponent: int) -> torch.Tensor | None:
    """``stats.compact_rows`` for CPU arena rows (int64 counts, float32 extras, rows contiguous)
    in one C loop instead of a dozen torch ops: the same N x ``LAYOUT.width`` float64 rows.
    None where the layout's fields are not the ones the C code writes."""
    if _FIELD_AT is None or counts.dtype != torch.int64 or extras.dtype != torch.float32:
        return None
    if counts.stride(1) != 1:
        counts = counts.contiguous()
    n = counts.shape[0]
    out = torch.empty(n, LAYOUT.width, dtype=torch.float64)
    if n:
        absmax = extras.data_ptr() + _ABSMAX * extras.stride(1) * extras.element_size()
        _library().compact(counts.data_ptr(), counts.stride(0), absmax, extras.stride(0), n, _OVERFLOW, _NEGINF,
                           normal_exponent, out.data_ptr(), LAYOUT.width, _FIELD_AT, LAYOUT.hist)
    return out


_MAX_FIELDS = (ctypes.c_int32 * max(1, len(LAYOUT.max_fields)))(*LAYOUT.max_fields)
_NAN_FIELD, _INF_FIELD, _NEGINF_FIELD = (LAYOUT.field[name] for name in ("nan", "inf", "neginf"))


def step_buffer(rows: torch.Tensor, used: torch.Tensor, n_events: int, event_keys: torch.Tensor,
                modes: torch.Tensor | None, n_keys: int, counts: torch.Tensor, extras: torch.Tensor, has_scale: bool,
                size: int, no_event: float) -> torch.Tensor:
    """``reducer.StepReducer.step_buffer`` on the CPU in one C loop: ``rows`` the Stats rows of
    the arena rows a step used (``counts``, ``extras``: float32, their sums of squares give the
    parameters' norms), ``used`` where each event's and then each parameter's row is among
    them, ``event_keys`` each event's (module, phase) key (-1: none), ``modes`` per event
    (``reducer.bad_events``). The last two slots (scale, found-inf) are left for the caller."""
    rows, used = rows.contiguous(), used.contiguous()
    if counts.stride(1) != 1:
        counts = counts.contiguous()
    if extras.dtype != torch.float32 or extras.stride(1) != 1:
        extras = extras.to(torch.float32).contiguous()
    flat = torch.empty(size, dtype=torch.float64)
    i64 = used.element_size()
    _library().step_buffer(
        rows.data_ptr(), LAYOUT.width, used.data_ptr(), event_keys.data_ptr(),
        modes.data_ptr() if modes is not None else None, n_events, n_keys, used.data_ptr() + n_events * i64,
        used.numel() - n_events, counts.data_ptr(),
        counts.stride(0), _SCALED, has_scale, extras.data_ptr() + _SUMSQ_AT, extras.stride(0), _MAX_FIELDS,
        len(LAYOUT.max_fields), _NAN_FIELD, _INF_FIELD, _NEGINF_FIELD, no_event, flat.data_ptr())
    return flat


# the state columns in ampaudit_update_rows' order (rule_api's names)
_COLUMN_AT = (ctypes.c_int32 * 12)(*(COLUMNS.index(name) for name in (
    "first", "last", "run_start", "best_start", "best_last", "count", "seen", "run_len", "best_len", "sum_value",
    "sum_total", "peak")))


def update_rows(rows: torch.Tensor, steps: list[int], prev: int, cond: torch.Tensor, value: torch.Tensor,
                total: torch.Tensor) -> torch.Tensor:
    """``conditions.update_steps`` in one C loop: the state rows (N x len(COLUMNS) float64)
    updated by the K logged ``steps`` in order (``cond``, ``value``, ``total``: K x N);
    returns new rows, ``rows`` untouched - the same numbers as the torch ops."""
    out = rows.to(torch.float64).contiguous().clone()
    cond = cond.to(torch.bool).contiguous()
    value, total = (x.to(torch.float64).contiguous() for x in (value, total))
    k, n = cond.shape
    step_array = (ctypes.c_int64 * max(1, k))(*steps)
    if n and k:
        _library().update_rows(out.data_ptr(), n, out.shape[1], _COLUMN_AT, step_array, k, prev, cond.data_ptr(),
                               value.data_ptr(), total.data_ptr())
    return out
