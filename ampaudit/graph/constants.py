"""Constants an op turns into tensor data (``masked_fill(mask, -1e9)``, ``x + 1e-8``): where
they sit in each op's arguments (rules.toml, AMP201's ``value_args``) and which of them were
written out rather than taken from a tensor's own dtype limits.

The graph rules ask whether the low dtype can hold them (AMP201-AMP203); convert's plan
keeps such ops in fp32 or clamps the constant."""

from __future__ import annotations

import linecache
import re
from collections.abc import Iterator

import torch

from ampaudit.core.rulebook import rule
from ampaudit.graph.fx_tracer import LOC
from ampaudit.graph.patterns import arg, number
from ampaudit.graph.recorder import DYNAMIC
from ampaudit.graph.view import GraphView


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


def holds_dtype_limit(view: GraphView, node) -> bool:
    """Whether the op takes a dtype limit that followed a tensor's dtype (``torch.finfo(x.dtype).min``):
    measured in fp32 it is fp32's limit, beyond the low dtype; in the low dtype it is that dtype's own."""
    for where in _value_args(view.kinds[node]):
        value = arg(node, where) if isinstance(where, int) else node.kwargs.get(where)
        c = number(view, value)
        if c is not None and _follows_dtype(node, c):
            return True
    return False


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
