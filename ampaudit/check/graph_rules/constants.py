"""AMP201-AMP203: a constant used as tensor data that the low dtype cannot hold.

A literal (or one computed at trace time, such as ``torch.finfo(torch.float32).min``) that
lands in an fp16/bf16 tensor: beyond the max it overflows (masked_fill raises, arithmetic
gives inf), below the smallest subnormal it flushes to zero (the classic ``+ 1e-8`` eps),
between subnormal and normal it keeps only a few bits.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from ampaudit.check.graph_rules import graph_rule
from ampaudit.core.findings import Finding
from ampaudit.graph.constants import constant_values
from ampaudit.graph.view import GraphView


def _fmt(c: float) -> str:
    return f"{c:.6g}"


@graph_rule("AMP201", "AMP202", "AMP203")
def constants_out_of_range(view: GraphView) -> Iterator[Finding]:
    dtype = view.dtype
    tiniest = dtype.tiniest
    for node in view.ops():
        if not view.runs_low(node):
            continue  # an fp32 tensor holds the constant fine
        op = view.kinds[node]
        for _, c in constant_values(view, node):
            magnitude = abs(c)
            if magnitude > dtype.max:
                yield view.finding("AMP201", node, value=_fmt(c), dtype=view.dtype, limit=f"{dtype.max:.6g}", op=op,
                                   fix=f"use torch.finfo(x.dtype).{'min' if c < 0 else 'max'} instead of {_fmt(c)}")
            elif magnitude < tiniest / 2:  # rounds to zero
                yield view.finding("AMP202", node, value=_fmt(c), dtype=view.dtype, limit=f"{tiniest:.3g}", op=op,
                                   fix=f"use an eps of at least {dtype.normal:.3g} for {view.dtype}")
            elif magnitude < dtype.normal:
                bits = _significant_bits(magnitude, tiniest)
                yield view.finding("AMP203", node, value=_fmt(c), dtype=view.dtype, bits=bits, op=op,
                                   normal=f"{dtype.normal:.3g}",
                                   fix=f"use a constant of at least {dtype.normal:.3g} for {view.dtype}")


def _significant_bits(magnitude: float, tiniest: float) -> int:
    # A subnormal is k * tiniest with k < 2**mantissa: it has as many bits as k.
    return int(math.log2(magnitude / tiniest)) + 1
