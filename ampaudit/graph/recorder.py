"""Fallback tracer: run the model on example inputs and record the ops that executed.

A ``TorchFunctionMode`` sees every torch function, functional and tensor method the
forward calls; each module's forward, wrapped for the run, gives module paths and keep torch.nn leaves whole (as fx
does). The result is an ordinary ``fx.GraphModule`` of the straight-line program that
ran, so every later pass (classification, hazard rules, range audit) works on it
unchanged. Branches not taken on these inputs are, by construction, not seen.

Recording bakes Python values into the graph: ``x.to(q.dtype)`` becomes a cast to one
dtype, ``torch.finfo(x.dtype).min`` one number. To tell those from casts and limits
written out in the code, the model runs in float64 while recording: whatever followed a
tensor's dtype shows up as float64 and is put back as fp32, marked ``DYNAMIC``.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx
from torch.overrides import TorchFunctionMode

from ampaudit.core.catalog import Catalog
from ampaudit.core.kept_attributes import attributes_kept
from ampaudit.core.tensors import has_tensor
from ampaudit.core.userframe import Loc, boundary, user_location
from ampaudit.graph.cast_source import dtype_written
from ampaudit.graph.fx_tracer import LOC, MODULE, fill_missing_locations, is_leaf
from ampaudit.graph.module_calls import forwards_wrapped
from ampaudit.graph.tree import is_namedtuple, map_tensors

# Tensor dunders that fx spells as operator functions; reflected ones swap operands.
_BINARY = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "div": operator.truediv, "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow,
    "matmul": operator.matmul, "and": operator.and_, "or": operator.or_, "xor": operator.xor,
    "lshift": operator.lshift, "rshift": operator.rshift,
}
_UNARY_OR_COMPARE = ("eq", "ne", "lt", "le", "gt", "ge", "neg", "pos", "abs", "invert", "getitem")
_OPERATORS: dict[str, tuple[Callable, bool]] = {
    **{f"__{name}__": (fn, False) for name, fn in _BINARY.items()},
    **{f"__r{name}__": (fn, True) for name, fn in _BINARY.items()},
    **{f"__{name}__": (getattr(operator, name), False) for name in _UNARY_OR_COMPARE},
}


_CONSTANT = "_ampaudit_constant"  # name prefix of tensors made outside any recorded op


class _GraphBuilder:
    """Turns observed calls into fx nodes, mapping live tensors back to their producers."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.graph = fx.Graph()
        self.attrs: dict[str, Any] = {}  # get_attr / call_module targets for GraphModule(root=dict)
        self._producers: dict[int, tuple[weakref.ref, fx.Node]] = {}
        self._params = {id(t): name for name, t in root.named_parameters(remove_duplicate=False)}
        self._params.update({id(t): name for name, t in root.named_buffers(remove_duplicate=False)})
        self._constants = 0
        self.module_path: list[str] = []
        self.autocast: list[bool] = []  # each torch.autocast the model entered, innermost last: enabled=?

    def bind(self, tensor: torch.Tensor, node: fx.Node) -> None:
        self._producers[id(tensor)] = (weakref.ref(tensor), node)

    def node_of(self, tensor: torch.Tensor, loc: Loc | None) -> fx.Node:
        hit = self._producers.get(id(tensor))
        if hit is not None and hit[0]() is tensor:
            return hit[1]
        name = self._params.get(id(tensor))
        if name is None:  # a tensor made outside any recorded op: keep it as a constant
            name = f"{_CONSTANT}{self._constants}"
            self._constants += 1
        self.attrs[name] = tensor
        node = self._node("get_attr", name, (), {}, loc)
        self.bind(tensor, node)
        return node

    def lift(self, value: Any, loc: Loc | None) -> Any:
        """Replace tensors inside args with their nodes; leave other values as constants."""
        if isinstance(value, torch.Tensor):
            return self.node_of(value, loc)
        if isinstance(value, (list, tuple)):
            lifted = [self.lift(v, loc) for v in value]
            return type(value)(*lifted) if is_namedtuple(value) else type(value)(lifted)
        if isinstance(value, dict):
            return {k: self.lift(v, loc) for k, v in value.items()}
        if isinstance(value, type) and value in _PYTHON_DTYPES:
            return _PYTHON_DTYPES[value]
        return value

    def _node(self, op: str, target: Any, args: tuple, kwargs: dict, loc: Loc | None) -> fx.Node:
        node = self.graph.create_node(op, target, args, kwargs)
        node.meta[LOC] = loc
        if self.autocast and not self.autocast[-1]:
            node.meta[AUTOCAST_OFF] = True
        if op == "call_module":
            node.meta[MODULE] = target
        else:
            node.meta[MODULE] = self.module_path[-1] if self.module_path else None
        return node

    def call(self, op: str, target: Any, args: tuple, kwargs: dict, out: Any, loc) -> fx.Node:
        node = self._node(op, target, self.lift(tuple(args), loc), self.lift(dict(kwargs), loc), loc)
        self.bind_outputs(node, out, loc)
        return node

    def bind_outputs(self, node: fx.Node, out: Any, loc) -> None:
        if isinstance(out, torch.Tensor):
            self.bind(out, node)
        elif isinstance(out, (tuple, list)):
            for index, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    self.bind(item, self._node("call_function", operator.getitem, (node, index), {}, loc))

    def placeholder(self, name: str, value: Any) -> None:
        node = self._node("placeholder", name, (), {}, None)
        if isinstance(value, torch.Tensor):
            self.bind(value, node)

    def output(self, value: Any) -> None:
        self._node("output", "output", (self.lift(_plain(value), None),), {}, None)


# A Python type where torch takes a dtype (transformers' Mamba: ``torch.tensor(0, dtype=int)``) is
# the dtype torch reads it as; fx would write it into the graph's code as "<class 'int'>".
_PYTHON_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def _plain(value: Any) -> Any:
    """Model outputs as plain containers fx can emit (ModelOutput becomes a dict, namedtuples tuples)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return tuple(items) if is_namedtuple(value) else type(value)(items)
    return value


class _RecordingMode(TorchFunctionMode):
    def __init__(self, builder: _GraphBuilder) -> None:
        super().__init__()
        self.builder = builder
        self.suppress = 0  # > 0 while inside a leaf module: its internals are not separate ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.suppress == 0:
            self._record(func, args, kwargs, out, sys._getframe(1))
        return out

    def _record(self, func, args, kwargs, out, frame) -> None:
        name = getattr(func, "__name__", "")
        if name == "__setitem__":
            # In place and returns None, but later reads of the tensor must see it.
            self.builder.call("call_function", operator.setitem, args, kwargs, None, user_location(frame))
            return
        if not has_tensor(out):
            return  # sizes, dims, items, bools: Python values, not ops to audit
        loc = user_location(frame)
        if name == "__get__":  # a tensor property such as x.T or x.mT
            attr = getattr(getattr(func, "__self__", None), "__name__", "attr")
            self.builder.call("call_function", getattr, (args[0], attr), {}, out, loc)
        elif name in _OPERATORS:
            fn, reflected = _OPERATORS[name]
            operands = (args[1], args[0], *args[2:]) if reflected else args
            self.builder.call("call_function", fn, operands, kwargs, out, loc)
        elif getattr(torch.Tensor, name, None) is func:
            self.builder.call("call_method", name, args, kwargs, out, loc)
        else:
            self.builder.call("call_function", func, args, kwargs, out, loc)


DYNAMIC = "ampaudit_dynamic_dtype"  # node.meta key: a dtype or dtype limit that followed a tensor
# node.meta key: recorded inside the model's own ``torch.autocast(..., enabled=False)`` (a
# block or a decorator: x-transformers' ``@autocast('cuda', enabled=False)`` on its rotary
# embedding), where autocast casts nothing
AUTOCAST_OFF = "ampaudit_autocast_off"


@contextlib.contextmanager
def _autocast_regions(stack: list[bool]) -> Iterator[None]:
    """While recording, each ``torch.autocast`` the model enters pushes the ``enabled`` it asked
    for (not what a CPU-only build makes of ``"cuda"``) onto ``stack``, and pops it on exit."""
    cls = torch.amp.autocast_mode.autocast
    init, enter, leave = cls.__init__, cls.__enter__, cls.__exit__
    signature = inspect.signature(init)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            asked = signature.bind(self, *args, **kwargs).arguments.get("enabled", True)
        except TypeError:
            asked = True
        init(self, *args, **kwargs)
        self._ampaudit_enabled = asked is not False

    def __enter__(self: Any) -> Any:
        # a decorator's autocast was made at import, before the recording: what torch kept of it
        stack.append(self.__dict__.get("_ampaudit_enabled", getattr(self, "_enabled", True) is not False))
        return enter(self)

    def __exit__(self: Any, *exc: Any) -> Any:
        if stack:
            stack.pop()
        return leave(self, *exc)

    cls.__init__, cls.__enter__, cls.__exit__ = __init__, __enter__, __exit__
    try:
        yield
    finally:
        cls.__init__, cls.__enter__, cls.__exit__ = init, enter, leave

_WIDE, _NARROW = torch.finfo(torch.float64), torch.finfo(torch.float32)
_LIMITS = {_WIDE.max: _NARROW.max, -_WIDE.max: -_NARROW.max, _WIDE.eps: _NARROW.eps,
           _WIDE.smallest_normal: _NARROW.smallest_normal}


@contextlib.contextmanager
def _in_float64(root: torch.nn.Module) -> Iterator[None]:
    """fp32 parameters and buffers as float64 for the block; the originals are put back."""
    saved = [(t, t.data) for t in (*root.parameters(), *root.buffers()) if t.dtype == torch.float32]
    try:
        for tensor, data in saved:
            tensor.data = data.double()
        yield
    finally:
        for tensor, data in saved:
            tensor.data = data


def _widen(value: Any) -> Any:
    return map_tensors(value, lambda t: t.double() if t.dtype == torch.float32 else t)


def _narrow_tensors(value: Any) -> Any:
    return map_tensors(value, lambda t: t.float() if t.dtype == torch.float64 else t)


def _narrow_value(value: Any, hits: list[bool]) -> Any:
    if value is torch.float64:
        hits.append(True)
        return torch.float32
    if isinstance(value, float) and value in _LIMITS:
        hits.append(True)
        return _LIMITS[value]
    if isinstance(value, (list, tuple)) and not is_namedtuple(value):
        return type(value)(_narrow_value(v, hits) for v in value)
    if isinstance(value, dict):
        return {k: _narrow_value(v, hits) for k, v in value.items()}
    return value


def _narrow(gm: fx.GraphModule) -> None:
    """Put a float64 recording back in fp32, marking what followed a tensor's dtype."""
    for node in gm.graph.nodes:
        hits: list[bool] = []
        node.args = _narrow_value(node.args, hits)
        node.kwargs = _narrow_value(node.kwargs, hits)
        if hits:
            node.meta[DYNAMIC] = True
        if node.op == "get_attr" and node.target.startswith(_CONSTANT):
            value = getattr(gm, node.target)
            if isinstance(value, torch.Tensor) and value.dtype == torch.float64:
                setattr(gm, node.target, value.float())
    gm.recompile()


@boundary
def record_trace(
    root: torch.nn.Module, args: tuple, kwargs: dict, catalog: Catalog
) -> tuple[fx.GraphModule, Any]:
    """Run ``root(*args, **kwargs)`` once, recording what ran. Returns (graph module, output).

    Records in float64 (see the module docstring); a model that cannot run in float64 is
    recorded as it is, in fp32.
    """
    try:
        with _in_float64(root):
            gm, out = _record(root, _widen(args), _widen(kwargs), catalog)
    except Exception:
        gm, out = _record(root, args, kwargs, catalog)
    else:
        _narrow(gm)
        out = _narrow_tensors(out)
    _mark_followed(gm)
    return gm, out


def _mark_followed(gm: fx.GraphModule) -> None:
    """Casts to fp32 whose source reads the dtype from a value (``w.to(x.dtype)`` after the
    model made ``x`` fp32 itself, which float64 cannot show) are marked ``DYNAMIC`` too."""
    for node in gm.graph.nodes:
        if node.op != "call_method" or node.target not in ("to", "type") or node.meta.get(DYNAMIC):
            continue
        if not any(a in (torch.float32, torch.float64) for a in (*node.args[1:], node.kwargs.get("dtype"))):
            continue
        loc = node.meta.get(LOC)
        if loc is not None and dtype_written(loc.file, loc.line, loc.column) is False:
            node.meta[DYNAMIC] = True


def _record(root: torch.nn.Module, args: tuple, kwargs: dict, catalog: Catalog) -> tuple[fx.GraphModule, Any]:
    builder = _GraphBuilder(root)
    mode = _RecordingMode(builder)
    names = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    # Modules that fx would keep whole (torch.nn leaves, catalog types) stay single nodes.
    default_leaf = fx.Tracer().is_leaf_module
    leaf_state: dict[int, bool] = {}

    def is_leaf_module(module: torch.nn.Module) -> bool:
        key = id(module)
        if key not in leaf_state:
            leaf_state[key] = is_leaf(
                catalog, module, default_leaf(module, names.get(key, "")))
        return leaf_state[key]

    def wrap(module: torch.nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        # Wrapping forward, not hooks: ``self.attention.forward(...)`` (Meta's llama) calls a
        # module without __call__, and its ops must still be its own.
        def recording(*args: Any, **kwargs: Any) -> Any:
            if mode.suppress:  # inside a leaf: its internals are not separate ops
                return forward(*args, **kwargs)
            path = names.get(id(module), "")
            leaf = is_leaf_module(module)
            loc = user_location(sys._getframe(1))
            builder.module_path.append(path)  # a failing forward ends the recording: no cleanup
            mode.suppress += leaf
            out = forward(*args, **kwargs)
            mode.suppress -= leaf
            if leaf:
                builder.attrs[path] = module
                builder.call("call_module", path, args, kwargs, out, loc)
            builder.module_path.pop()
            return out
        return recording

    with attributes_kept(root), forwards_wrapped(root, wrap):
        bound = inspect.signature(root.forward).bind(*args, **kwargs)
        for name, value in bound.arguments.items():
            builder.placeholder(name, value)
        with mode, _autocast_regions(builder.autocast):
            out = root(*args, **kwargs)
        builder.output(out)
    fill_missing_locations(builder.graph, root)
    return fx.GraphModule(builder.attrs, builder.graph, type(root).__name__), out
