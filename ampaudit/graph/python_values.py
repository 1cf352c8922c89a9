"""Nodes of a traced graph that compute Python values, not tensors: sizes and shapes read
off a tensor (``x.shape[1]``, ``x.size(-1)``), the integer arithmetic done on them
(``C // self.num_heads``, ``head_dim ** -0.5``) and comparisons of them.

torch.fx records that arithmetic as graph nodes, and the catalog would classify
``floordiv`` or ``pow`` like tensor ops (a pow of sizes "needs fp32"): these nodes have no
precision. Checks (``torch._assert``) are in the catalog, as ops that compute nothing.
"""

from __future__ import annotations

import builtins
import math
import operator

from torch import fx

# Tensor methods and attributes that return Python values (ints, tuples, dtypes, bools).
_METADATA_METHODS = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "stride", "storage_offset",
    "is_contiguous", "is_floating_point", "is_complex", "get_device", "item", "tolist",
})
_METADATA_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "layout", "requires_grad"})
_PURE_MODULES = frozenset({operator.__name__, "_operator", builtins.__name__, math.__name__})


def _is_python_function(target: object) -> bool:
    return getattr(target, "__module__", None) in _PURE_MODULES


def python_values(gm: fx.GraphModule) -> frozenset[fx.Node]:
    """The nodes whose value is a Python scalar, shape or flag read off tensors' metadata."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target in _METADATA_METHODS:
            found.add(node)
        elif node.op == "call_function" and node.target is builtins.getattr:
            owner = node.args[0] if node.args else None
            if (len(node.args) > 1 and node.args[1] in _METADATA_ATTRS) or owner in found:
                found.add(node)
        elif node.op == "call_function" and _is_python_function(node.target):
            inputs = node.all_input_nodes
            if inputs and all(i in found for i in inputs):
                found.add(node)
    return frozenset(found)
