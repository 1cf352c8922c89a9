"""torch.fx tracing that stamps every node with the user's file:line and module path."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch import fx

from ampaudit.core.catalog import Catalog
from ampaudit.core.errors import USER_CODE_ERRORS
from ampaudit.core.kept_attributes import attributes_kept
from ampaudit.core.userframe import Loc, boundary, traceback_location, user_location

LOC = "ampaudit_loc"  # node.meta key: (file, line) of the user's source
MODULE = "ampaudit_module"  # node.meta key: qualified module path or None
CHECKPOINT = "ampaudit_checkpoint"  # node.meta key: the Checkpoint whose function made the node


def forward_location(module: torch.nn.Module) -> Loc:
    """Where ``module.forward`` is defined: the line placeholders and outputs point at."""
    fn = inspect.unwrap(type(module).forward)
    code = getattr(fn, "__code__", None)
    if code is None:
        return Loc("<unknown>", 1)
    return Loc(code.co_filename, code.co_firstlineno)


def is_leaf(catalog: Catalog, module: torch.nn.Module, default: bool) -> bool:
    """torch.nn modules (fx's default) and any module type the catalog classifies as a unit."""
    return default or catalog.kind_of_module_type(type(module)) is not None


class AuditTracer(fx.Tracer):
    """An fx Tracer that records, per node, the innermost user frame and the module path.

    ``opaque`` names submodules to keep as leaves because tracing through them failed.
    """

    def __init__(self, catalog: Catalog, opaque: Collection[str] = (), *, functions_as_leaves: bool = False) -> None:
        super().__init__()
        self.catalog = catalog
        self.opaque = frozenset(opaque)
        self.functions_as_leaves = functions_as_leaves
        # convert traces buffers as graph values: ``self.pe[:, : x.size(1)]`` slices a buffer by a
        # traced size (a constant tensor cannot be sliced by one)
        self.proxy_buffer_attributes = functions_as_leaves
        self.failed_module: str | None = None  # innermost module whose forward raised

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        if not self.functions_as_leaves:
            return super().trace(root, concrete_args)
        with _autograd_functions_as_nodes(self), _checkpoints_as_regions(self):
            return super().trace(root, concrete_args)

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.opaque:
            return True
        return is_leaf(self.catalog, m, super().is_leaf_module(m, module_qualified_name))

    def call_module(self, m: torch.nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except USER_CODE_ERRORS:
            if self.failed_module is None:
                self.failed_module = self.path_of_module(m)
            raise

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta[LOC] = user_location(sys._getframe(1))
        stack = node.meta.get("nn_module_stack")
        if kind == "call_module":
            node.meta[MODULE] = target
        elif stack:
            node.meta[MODULE] = next(reversed(stack.values()))[0]
        else:
            node.meta[MODULE] = None
        return node


@contextlib.contextmanager
def _autograd_functions_as_nodes(tracer: fx.Tracer) -> Iterator[None]:
    """While ``tracer`` traces, a custom ``torch.autograd.Function`` called on traced values is
    one node that calls the Function, not the ops of its forward: traced through, autograd would
    differentiate those ops instead of calling the Function's own backward (a straight-through
    estimator's ``round`` would give a zero gradient)."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not _traced_by(tracer, args, kwargs):
            return original.__func__(cls, *args, **kwargs)
        if cls is torch.utils.checkpoint.CheckpointFunction:  # checkpoint(..., use_reentrant=True)
            function, preserve, *inputs = args
            with _region(tracer, Checkpoint({"use_reentrant": True, "preserve_rng_state": preserve})):
                return function(*inputs)
        return tracer.create_proxy("call_function", autograd_function_call(cls), args, kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


def _traced_by(tracer: fx.Tracer, args: Any, kwargs: Any) -> bool:
    return any(isinstance(a, fx.Proxy) and a.tracer is tracer for a in pytree.tree_leaves((args, kwargs)))


@dataclass(eq=False)
class Checkpoint:
    """One call of ``torch.utils.checkpoint.checkpoint`` met while tracing: the keyword arguments
    to call it with again (``use_reentrant``, ``preserve_rng_state``, ``context_fn``, ...). The
    nodes its function made carry it in ``node.meta[CHECKPOINT]``."""

    kwargs: dict[str, Any]


@contextlib.contextmanager
def _region(tracer: fx.Tracer, checkpoint: Checkpoint) -> Iterator[None]:
    """Mark the nodes traced inside as made by ``checkpoint``'s function; a checkpoint inside
    another is part of the outer one (only the outermost is called again)."""
    last = tracer.graph._root.prev  # the graph's last node before the function runs
    yield
    node = last.next
    while node is not tracer.graph._root:
        if node.op != "placeholder":
            node.meta.setdefault(CHECKPOINT, checkpoint)
        node = node.next


@contextlib.contextmanager
def _checkpoints_as_regions(tracer: fx.Tracer) -> Iterator[None]:
    """While ``tracer`` traces, ``torch.utils.checkpoint.checkpoint`` (and ``checkpoint_sequential``,
    which calls it) on traced values traces its function's ops as usual and marks them, so that
    convert can call them under checkpoint again (convert/checkpoints.py) - traced through
    unmarked, the converted model would keep every activation of the checkpointed blocks.
    ``use_reentrant=True`` goes through ``CheckpointFunction.apply`` (see
    ``_autograd_functions_as_nodes``); ``use_reentrant=False`` through the generator patched here,
    whose two steps come just before and just after the function runs."""
    module = torch.utils.checkpoint
    original = module._checkpoint_without_reentrant_generator

    def generator(fn: Any, preserve: bool = True, context_fn: Any = module.noop_context_fn,
                  determinism_check: str = module._DEFAULT_DETERMINISM_MODE, debug: bool = False,
                  *rest: Any, **kwargs: Any) -> Iterator[None]:
        if not _traced_by(tracer, rest, kwargs):
            yield from original(fn, preserve, context_fn, determinism_check, debug, *rest, **kwargs)
            return
        options: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": preserve}
        if context_fn is not module.noop_context_fn:
            options["context_fn"] = context_fn
        if determinism_check != module._DEFAULT_DETERMINISM_MODE:
            options["determinism_check"] = determinism_check
        if debug:
            options["debug"] = debug
        with _region(tracer, Checkpoint(options)):
            yield

    module._checkpoint_without_reentrant_generator = generator
    try:
        yield
    finally:
        module._checkpoint_without_reentrant_generator = original


def checkpoint_of(node: fx.Node) -> Checkpoint | None:
    """The checkpoint call whose function made ``node`` (traced with ``functions_as_leaves``)."""
    return node.meta.get(CHECKPOINT)


@functools.cache
def autograd_function_call(function: type) -> Callable[..., Any]:
    """The target of a Function's node: ``Function.apply``, named after the Function (the generated
    code reads ``RoundSTE_apply(x)``) and marked with it (``autograd_function``)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return function.apply(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{function.__name__}_apply"
    call.autograd_function = function  # type: ignore[attr-defined]
    return call


def autograd_function_of(node: fx.Node) -> type | None:
    """The custom autograd Function a node calls (traced with ``functions_as_leaves``), or None."""
    return getattr(node.target, "autograd_function", None) if node.op == "call_function" else None


def custom_fwd_cast(function: type) -> torch.dtype | None:
    """The dtype ``torch.amp.custom_fwd(cast_inputs=...)`` on the Function's forward casts its
    inputs to under autocast (and runs it with autocast off); None without one."""
    forward = inspect.getattr_static(function, "forward", None)
    forward = getattr(forward, "__func__", forward)  # a staticmethod
    try:
        cast = inspect.getclosurevars(forward).nonlocals.get("cast_inputs")
    except (TypeError, ValueError):
        return None
    return cast if isinstance(cast, torch.dtype) else None


@dataclass
class FxFailure:
    """Why tracing a module failed, and the user's line where it did."""

    module: str  # qualified path, "" for the traced root
    type_name: str
    message: str
    loc: Loc  # the user's line where tracing failed (forward's def if unknown)


@boundary
def fx_trace(
    root: torch.nn.Module, catalog: Catalog, opaque: Collection[str] = (), concrete_args: dict[str, Any] | None = None,
    *, functions_as_leaves: bool = False,
) -> tuple[fx.GraphModule | None, FxFailure | None]:
    """Trace ``root``; on failure return which (innermost) module failed and where.
    ``concrete_args``: forward's non-tensor arguments to specialise on (module_calls.py);
    ``functions_as_leaves``: keep each custom autograd Function one node (what convert runs)."""
    tracer = AuditTracer(catalog, opaque, functions_as_leaves=functions_as_leaves)
    try:
        with attributes_kept(root):  # a forward that sets self.x = proxy leaves nothing behind
            graph = tracer.trace(root, concrete_args=concrete_args)
            # made before the attributes go back: it takes the tensor constants fx stored on the
            # root while tracing (``_tensor_constant0``: a torch.tensor(...) made in forward)
            gm = fx.GraphModule(tracer.root, graph, type(root).__name__)
    except USER_CODE_ERRORS as exc:  # fx raises TraceError, TypeError, RuntimeError, ... from user code
        path = tracer.failed_module or ""
        failed = root.get_submodule(path) if path else root
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        loc = traceback_location(exc.__traceback__) or forward_location(failed)
        return None, FxFailure(path, type(failed).__name__, message, loc)
    if concrete_args:
        _keep_argument_names(gm, concrete_args)
    python_scalars(gm)
    fill_missing_locations(gm.graph, root)
    return gm, None


def python_scalars(gm: fx.GraphModule) -> None:
    """NumPy scalars in the graph's arguments as the Python numbers they equal: fx writes one
    as its repr, ``np.float64(0.76...)`` under NumPy 2, into code that has no ``np`` - EDM2's
    ``a.lerp(b, t) / np.sqrt(...)`` traced, then raised NameError when the graph ran."""
    np = sys.modules.get("numpy")  # never imported: no NumPy scalar can be in the graph
    if np is None:
        return
    changed = False

    def plain(value: Any) -> Any:
        nonlocal changed
        if isinstance(value, np.generic) and np.ndim(value) == 0:
            changed = True
            return value.item()
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(plain(v) for v in value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    for node in gm.graph.nodes:
        node.args, node.kwargs = plain(node.args), plain(node.kwargs)
    if changed:
        gm.recompile()


def _keep_argument_names(gm: fx.GraphModule, concrete_args: dict[str, Any]) -> None:
    """fx names a specialised argument's parameter ``X_1`` in the traced forward, but the parent
    passes it by name: BertModel calls ``self.embeddings(input_ids=..., position_ids=None)``,
    and the converted child raised "unexpected keyword argument 'position_ids'". The parameter
    gets its name back (the node's own name, which the plan uses, stays)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.target, str)]
    taken = {n.target for n in placeholders}
    renamed = False
    for node in placeholders:
        base, sep, suffix = node.target.rpartition("_")
        if sep and suffix.isdigit() and base in concrete_args and base not in taken:
            node.target, renamed = base, True
            taken.add(base)
    if renamed:
        gm.recompile()


def fill_missing_locations(graph: fx.Graph, root: torch.nn.Module) -> None:
    """Placeholders, outputs and other nodes made outside user code point at forward's def."""
    default = forward_location(root)
    for node in graph.nodes:
        if node.meta.get(LOC) is None:
            node.meta[LOC] = default
        node.meta.setdefault(MODULE, None)
