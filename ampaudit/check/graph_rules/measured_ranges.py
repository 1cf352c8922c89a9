"""AMP301-AMP303: what the range probe measured on the example inputs.

Reported where the op runs in low precision unless the code upcasts it. Overflow is
reported at its origin - the node whose own output leaves the range while its inputs fit -
so an inf that a later tanh or clamp hides is still pinned to the op that produced it.
Flushing is reported where values first vanish: not again on an identity, a dropout, a
reshape or a later layer fed the flushed values.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import fx

from ampaudit.check.graph_rules import graph_rule
from ampaudit.core.findings import Finding, Precision
from ampaudit.core.rulebook import rule
from ampaudit.graph.constants import holds_dtype_limit
from ampaudit.graph.dtype_flow import LOW
from ampaudit.graph.range_probe import MEASURED, Measured
from ampaudit.graph.view import GraphView

_FP32_MAX = float(torch.finfo(torch.float32).max)


def _measured(node: fx.Node) -> Measured | None:
    return node.meta.get(MEASURED)


def _flushed_before(view: GraphView, node: fx.Node, min_flush: float) -> bool:
    """An op fed values that already flushed in an op before it: reported there, where they
    first vanish (as overflow is reported where it starts), not once per later layer - nor
    as this op's precision loss, which is the same zeros seen again."""
    for source in node.all_input_nodes:
        m = _measured(source)
        if m is not None and source.op.startswith("call_") and m.flush >= min_flush and view.runs_low(source):
            return True
    return False


def _low_under_autocast(view: GraphView, node: fx.Node, m: Measured) -> bool:
    """An op the fp32 recording computes in fp32 (the code upcasts, or a branch on a weight's
    dtype did not run: LongT5's norm returns fp32 to its projections there) that autocast runs
    in the low dtype - where an overflow it measured is one too (LongT5's ``scores +=
    position_bias``). Not a value at fp32's own limit: a ``torch.finfo(x.dtype).min`` fill of a
    tensor the code made fp32 (GPT-Neo's mask), which under autocast follows the low dtype; nor
    an op of a module the model declares fp32 (``_keep_in_fp32_modules``), taken as fp32."""
    return view.flow.get(node) == LOW and m.absmax < _FP32_MAX and node not in view.fp32_declared


def _computes_low(view: GraphView, node: fx.Node, m: Measured) -> bool:
    """Where an overflow the op measured is one: in a model cast down, or under autocast."""
    return view.runs_low(node) or _low_under_autocast(view, node, m)


def _limit_only(view: GraphView, node: fx.Node, m: Measured) -> bool:
    """The overflow is a ``torch.finfo(x.dtype).min`` fill measured in fp32: in the low dtype it
    would be that dtype's own limit."""
    return m.absmax >= _FP32_MAX and holds_dtype_limit(view, node)


def _overflows(view: GraphView, node: fx.Node) -> bool:
    """An input that overflowed the low dtype already. Values that stay in fp32 (LongT5's -1e10
    mask bias) overflow nothing until an op stores them low (``scores += position_bias``, into
    fp16 scores): that op is the origin."""
    m = _measured(node)
    return m is not None and m.overflow > 0 and _computes_low(view, node, m)


@graph_rule("AMP301", "AMP302", "AMP303")
def measured_ranges(view: GraphView) -> Iterator[Finding]:
    limit = view.dtype.max
    min_flush = rule("AMP302").params["min_fraction"]
    min_lost = rule("AMP303").params["min_bits_lost"]
    for node in view.ops():
        m = _measured(node)
        if m is None:
            continue
        if m.overflow > 0 and _computes_low(view, node, m) \
                and not any(_overflows(view, i) for i in node.all_input_nodes) and not _limit_only(view, node, m):
            yield view.finding("AMP301", node, absmax=f"{m.absmax:.3g}", dtype=view.dtype, limit=f"{limit:.6g}",
                               percent=_percent(m.overflow),
                               fix="run this op in fp32 (keep it out of autocast, or upcast its input)")
        elif not view.runs_low(node):  # flushing and lost bits: in a model cast down only
            continue
        elif _flushed_before(view, node, min_flush):
            continue  # its inputs vanished already: their op is the one to fix
        elif m.flush >= min_flush:
            yield view.finding("AMP302", node, percent=_percent(m.flush), dtype=view.dtype,
                               smallest=f"{m.min_nonzero:.3g}" if m.min_nonzero is not None else "0",
                               fix="keep this op in fp32 or rescale its values")
        elif (m.bits_lost is not None and m.bits_lost >= min_lost
              and view.policy(node) is not None and view.policy(node).precision is not Precision.FP32):
            yield view.finding("AMP303", node, lost=m.bits_lost, dtype=view.dtype,
                               total=view.dtype.mantissa, sqnr=f"{m.sqnr_db:.1f}",
                               fix="keep this op in fp32")


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.3g}%"
