"""AMP201-AMP203: a constant used as tensor data that the low dtype cannot hold.

A literal (or one computed at trace time, such as ``torch.finfo(torch.float32).min``) that
lands in an fp16/bf16 tensor: beyond the max it overflows (masked_fill raises, arithmetic
gives inf), below the smallest subnormal it flushes to zero (the classic ``+ 1e-8`` eps),
between subnormal and normal it keeps only a few bits.
"""

from __future__ import annotations

import linecache
import math
import re
from collections.abc import Iterator

import torch

from ampaudit.check.graph_view import GraphView
from ampaudit.check.patterns import arg, finfo, number, smallest_subnormal
from ampaudit.check.rules import graph_rule
from ampaudit.core.findings import Finding
from ampaudit.core.rulebook import rule
from ampaudit.graph.fx_tracer import LOC
from ampaudit.graph.recorder import DYNAMIC


def _value_args(kind: str) -> list[int | str]:
    """Where an op takes its tensor-data constants: positions and keyword names (rules.toml)."""
    return rule("AMP201").params["value_args"].get(kind, [])


def constant_values(view: GraphView, node) -> Iterator[tuple[int | str, float]]:
    """(argument, value) for each nonzero constant the op turns into tensor data - except
    dtype limits that followed a tensor's dtype (see ``_follows_dtype``)."""
    # A parameter is passed by position or by keyword, never both: no double counting.
    for where in _value_args(view.kinds[node]):
        value = arg(node, where) if isinstance(where, int) else node.kwargs.get(where)
        c = number(view, value)
        if c is not None and c != 0.0 and not _follows_dtype(node, c):
            yield where, c


def _fmt(c: float) -> str:
    return f"{c:.6g}"


_FP32_FINFO = re.compile(r"finfo\(\s*torch\.float(32)?\s*\)")


def _follows_dtype(node, c: float) -> bool:
    """``torch.finfo(x.dtype).min`` was evaluated once, in fp32, while tracing; on a
    low-precision tensor it would be that dtype's own limit. The value alone cannot tell it
    from a hard-coded ``torch.finfo(torch.float32).min``, so read the line that wrote it."""
    if abs(c) != torch.finfo(torch.float32).max:
        return False
    if node.meta.get(DYNAMIC):  # recorded in float64: this limit followed a tensor's dtype
        return True
    loc = node.meta[LOC]
    text = linecache.getline(loc.file, loc.line)
    return "finfo(" in text and not _FP32_FINFO.search(text)


@graph_rule("AMP201", "AMP202", "AMP203")
def constants_out_of_range(view: GraphView) -> Iterator[Finding]:
    info = finfo(view.dtype)
    tiniest = smallest_subnormal(view.dtype)
    for node in view.ops():
        if not view.runs_low(node):
            continue  # an fp32 tensor holds the constant fine
        op = view.kinds[node]
        for _, c in constant_values(view, node):
            magnitude = abs(c)
            if magnitude > info.max:
                yield view.finding("AMP201", node, value=_fmt(c), dtype=view.dtype, limit=f"{info.max:.6g}", op=op,
                                   fix=f"use torch.finfo(x.dtype).{'min' if c < 0 else 'max'} instead of {_fmt(c)}")
            elif magnitude < tiniest / 2:  # rounds to zero
                yield view.finding("AMP202", node, value=_fmt(c), dtype=view.dtype, limit=f"{tiniest:.3g}", op=op,
                                   fix=f"use an eps of at least {info.smallest_normal:.3g} for {view.dtype}")
            elif magnitude < info.smallest_normal:
                bits = _significant_bits(magnitude, tiniest)
                yield view.finding("AMP203", node, value=_fmt(c), dtype=view.dtype, bits=bits, op=op,
                                   normal=f"{info.smallest_normal:.3g}",
                                   fix=f"use a constant of at least {info.smallest_normal:.3g} for {view.dtype}")


def _significant_bits(magnitude: float, tiniest: float) -> int:
    # A subnormal is k * tiniest with k < 2**mantissa: it has as many bits as k.
    return int(math.log2(magnitude / tiniest)) + 1
