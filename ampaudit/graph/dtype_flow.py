"""Which dtype each node computes in - a pass over an fx graph, in two modes.

``autocast``: torch.autocast casts per op: listed ops run in the low dtype ("low") or are
upcast ("fp32"); everything else follows its inputs (type promotion for binary ops). This
tells which fp32-needing ops autocast would leave in fp16 or bf16.

``low``: the model itself runs in the low dtype (``model.half()``, a converted model):
inputs and weights are low, and only the casts written in the code produce fp32. Hazard
rules use this mode: a pattern is unsafe unless the code upcasts it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
from torch import fx

from ampaudit.core.catalog import Catalog
from ampaudit.core.findings import Precision
from ampaudit.graph.range_probe import DTYPE, writes_in_place
from ampaudit.graph.recorder import AUTOCAST_OFF, DYNAMIC

LOW = "low"  # the target low-precision dtype (float16 or bfloat16)
FP32 = "fp32"

_CAST_METHODS = {"half": LOW, "bfloat16": LOW, "float": FP32, "double": FP32}


def _dtype_flow(dtype: torch.dtype) -> str | None:
    if dtype in (torch.float16, torch.bfloat16):
        return LOW
    if dtype.is_floating_point:
        return FP32
    return None


def _not_float(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A node known to hold a non-float tensor: an integer or bool buffer (a causal mask),
    or any node the range probe saw produce one (token ids, masks, indices)."""
    dtype = node.meta.get(DTYPE)
    if dtype is None and node.op == "get_attr":
        try:
            value = _fetch(gm, node.target)
        except AttributeError:
            value = None
        dtype = value.dtype if isinstance(value, torch.Tensor) else None
    return isinstance(dtype, torch.dtype) and not (dtype.is_floating_point or dtype.is_complex)


def _fetch(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def non_float_in_code(gm: fx.GraphModule, kinds: Mapping[fx.Node, str], catalog: Catalog, *,
                      python: Collection[fx.Node] = ()) -> frozenset[fx.Node]:
    """The nodes the code alone shows to hold no floating-point tensor - Python values (sizes,
    ``math.sqrt(d_k)``), comparisons and other non-float ops, integer and bool buffers -
    whatever the example inputs are (a plan made again without them must agree)."""
    non_float = catalog.trait("non_float")
    found = set(python)
    for node in gm.graph.nodes:
        if kinds.get(node, "") in non_float or explicit_cast(node) is None:
            found.add(node)
        elif node.op == "get_attr":
            try:
                value = _fetch(gm, node.target)
            except AttributeError:
                continue
            if isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex()):
                found.add(node)
    return frozenset(found)


def explicit_cast(node: fx.Node) -> str | bool | None:
    """LOW/FP32/None for a node that casts or fixes its dtype; False when it does not."""
    if node.op == "call_method" and node.target in _CAST_METHODS:
        return _CAST_METHODS[node.target]
    dtype = node.kwargs.get("dtype")
    if not isinstance(dtype, torch.dtype) and node.op == "call_method" and node.target in ("to", "type"):
        dtype = next((a for a in node.args[1:] if isinstance(a, torch.dtype)), None)
    if isinstance(dtype, torch.dtype):
        return _dtype_flow(dtype)
    return False


def autocast_flow(gm: fx.GraphModule, kinds: Mapping[fx.Node, str], catalog: Catalog, *,
                  python: Collection[fx.Node] = ()) -> dict[fx.Node, str | None]:
    """Map every node to LOW, FP32, or None (not a floating-point tensor) under autocast.

    ``python``: nodes that compute Python values (sizes, flags): None."""
    return _flow(gm, kinds, catalog, autocast=True, python=python)


def low_precision_flow(gm: fx.GraphModule, kinds: Mapping[fx.Node, str], catalog: Catalog, *,
                       python: Collection[fx.Node] = (), fp32: Collection[fx.Node] = ()) -> dict[fx.Node, str | None]:
    """The same map for a model whose inputs and weights are in the low dtype. ``fp32``: nodes
    of modules the model keeps in fp32 when it is cast down (their weights stay fp32); under
    autocast they would still run in the low dtype, so only this mode reads them."""
    return _flow(gm, kinds, catalog, autocast=False, python=python, fp32=fp32)


def _flow(gm: fx.GraphModule, kinds: Mapping[fx.Node, str], catalog: Catalog, *, autocast: bool,
          python: Collection[fx.Node] = (), fp32: Collection[fx.Node] = ()):
    flow: dict[fx.Node, str | None] = {}
    non_float = catalog.trait("non_float")  # masks, indices, sizes
    for node in gm.graph.nodes:
        inputs = [flow[n] for n in node.all_input_nodes if flow.get(n) is not None]
        if node in python or _not_float(gm, node):
            flow[node] = None
            continue
        if node in fp32:
            flow[node] = FP32
            continue
        if node.op in ("placeholder", "get_attr"):
            flow[node] = FP32 if autocast else LOW  # model inputs, weights and buffers
            continue
        if node.op == "output":
            continue
        if node.meta.get(DYNAMIC) and node.op == "call_method" and node.target in ("to", "type"):
            # x.to(other.dtype), recorded: in a low-precision model that is the working dtype;
            # under autocast, take the input's (the usual case: casting back after an fp32 step).
            flow[node] = (inputs[0] if inputs else FP32) if autocast else LOW
            continue
        cast = explicit_cast(node)
        if cast is not False:
            flow[node] = cast
            continue
        if node.op == "call_method" and node.target == "type_as" and len(node.args) > 1:
            other = node.args[1]
            flow[node] = flow.get(other) if isinstance(other, fx.Node) else None
            continue
        kind = kinds.get(node, "")
        if kind in non_float:
            flow[node] = None
            continue
        target = node.args[0] if node.args else None
        if node.op != "call_module" and isinstance(target, fx.Node) and flow.get(target) is not None \
                and writes_in_place(node, gm):
            # an in-place op keeps its target's dtype, whatever its other inputs: LongT5's
            # ``scores += position_bias`` writes a -1e10 fp32 bias into fp16 scores (-inf)
            flow[node] = flow[target]
            continue
        policy = catalog.lookup(kind)
        # inside the model's own torch.autocast(enabled=False), autocast casts nothing
        behaviour = policy.autocast if policy and autocast and not node.meta.get(AUTOCAST_OFF) else "none"
        if behaviour == "fp16":
            flow[node] = LOW
        elif behaviour in ("fp32", "banned"):
            flow[node] = FP32
        elif node.op == "call_module" and not inputs:
            flow[node] = FP32 if autocast else LOW  # e.g. an embedding: output follows its weight
        elif policy is not None and policy.precision is Precision.PROMOTE:
            flow[node] = FP32 if FP32 in inputs else (LOW if inputs else FP32)
        else:
            # Unlisted ops follow their first floating input; with none (a factory such as
            # arange or full) they produce the default dtype, fp32.
            flow[node] = inputs[0] if inputs else FP32
    return flow


def first_float_input(node: fx.Node, flow: Mapping[fx.Node, str | None]) -> str | None:
    return next((flow[n] for n in node.all_input_nodes if flow.get(n) is not None), None)
