"""AMP213 / AMP214: hard-coded dtype casts inside forward.

``.half()`` / ``.to(torch.float16)`` pins an op to fp16 even where autocast would upcast it
(and breaks bf16 runs); ``.double()`` is 30-60x slower on GPUs and defeats AMP.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ampaudit.check.graph_rules import graph_rule
from ampaudit.core.findings import Finding
from ampaudit.graph.view import GraphView

_LOW = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _cast_target(node) -> torch.dtype | None:
    if node.op == "call_method" and node.target in ("half", "bfloat16", "double"):
        return {"half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}[node.target]
    if node.op == "call_method" and node.target in ("to", "type"):
        dtype = node.kwargs.get("dtype")
        if dtype is None:
            dtype = next((a for a in node.args[1:] if isinstance(a, torch.dtype)), None)
        return dtype if isinstance(dtype, torch.dtype) else None
    return None


@graph_rule("AMP213", "AMP214")
def explicit_casts(view: GraphView) -> Iterator[Finding]:
    for node in view.ops():
        dtype = _cast_target(node)
        if dtype in _LOW:
            yield view.finding("AMP213", node, dtype=_LOW[dtype],
                               fix="drop the cast and let autocast choose, or cast with x.to(other.dtype)")
        elif dtype is torch.float64:
            yield view.finding("AMP214", node, fix="use .float() (fp32) instead of float64")
