"""Where a non-finite value is born, down to the op and the user's source line.

Nothing here runs on a healthy step. The monitor keeps each module call of the step (its
inputs and autocast state: ``Call``); when the step boundary finds a non-finite value, it
replays only the module that produced it:

- forward: the module's forward runs again on copies of its inputs under a dispatch mode
  that checks each aten op; the first op whose inputs were clean and whose output is not
  is the producer (``replay_forward``);
- backward: the module whose backward turned finite incoming gradients into non-finite
  outgoing ones is found from the step's events (``blame_backward``); its forward runs again
  with grad enabled, and a backward with gradients drawn from the recorded histogram of its
  real incoming gradients names the first autograd node that made them non-finite, with
  the forward line of the op that created that node (``replay_backward``).

Replays never touch the run: the random state, the module's buffers and the parameters'
``.grad`` are left as they were, and a replay that fails only says why.

Intentional infinities are not errors: a tensor whose non-finite values are all ``-inf``
(a ``masked_fill``/``where`` attention mask) is *masked*, not bad, unless arithmetic made it.
"""

from __future__ import annotations

import copy as copy_module
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ampaudit.core.kept_attributes import attributes_kept
from ampaudit.core.tensors import iter_tensors
from ampaudit.core.userframe import boundary, classify, user_location

FINITE, MASKED, BAD = 0, 1, 2  # a tensor's state; BAD: NaN or +inf (or -inf that arithmetic made)
# Ops that write a given value: -inf out of them is a mask the user asked for.
_WRITERS = {"masked_fill", "masked_fill_", "where", "full", "full_like", "fill", "fill_", "new_full",
            "scalar_tensor", "index_put", "index_put_", "masked_scatter", "masked_scatter_"}
# Ops whose output is memory not yet written: whatever bits it holds (NaN patterns included)
# are not values any op made.
_UNWRITTEN = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "empty_permuted"}
_SENTINEL = 1e8  # a cast that turns values this large into -inf casts a mask (-1e9, finfo.min): not an overflow
DEVICE_TYPES = ("cpu", "cuda")


@dataclass
class Call:
    """One module call of the step: what a replay needs."""

    module: torch.nn.Module
    args: tuple
    kwargs: dict
    autocast: tuple  # per device type in DEVICE_TYPES: (enabled, dtype)

    def __deepcopy__(self, memo: dict) -> None:
        # a deep copy of the watched model made mid-step (an EMA created after the forward) copies
        # the recorder: the arguments carry autograd history, which refuses to be copied. The
        # copy's recorder replays nothing
        return None


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)
# autocast off everywhere (an fp32 or .half() run): the dtype is not used by a replay then
_OFF = tuple((False, torch.get_autocast_dtype(d)) for d in DEVICE_TYPES)


def autocast_state() -> tuple:
    """The autocast state in force now, to replay a call under it (per device type in
    DEVICE_TYPES; written out: it runs at every module call of a recorded step)."""
    if _any_autocast is not None and not _any_autocast():
        return _OFF
    enabled, dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
    return (enabled("cpu"), dtype("cpu")), (enabled("cuda"), dtype("cuda"))


def autocast_contexts(state: tuple) -> list[torch.autocast]:
    """The autocast contexts that put ``state`` (``autocast_state``'s) back in force, to enter
    in order: one per device type it enables, or that is enabled now and it disables."""
    return [torch.autocast(d, dtype=dtype, enabled=enabled)
            for d, (enabled, dtype) in zip(DEVICE_TYPES, state, strict=True)
            if enabled or torch.is_autocast_enabled(d)]


@dataclass
class Origin:
    """The op a non-finite value came from. ``op``: the aten op (forward) or the autograd
    node (backward); ``file``/``line``: the user's source line of the forward op."""

    op: str | None = None
    file: str | None = None
    line: int | None = None
    note: str | None = None  # why the op is unknown, or what else to know
    outside: bool = False  # the call's inputs were already non-finite: made before this module
    state: str | None = None  # the module's parameter or buffer that already held NaN/Inf ("parameter weight")
    cleared: bool = False  # a backward replay ran and made no NaN/Inf
    # the op made NaN/+inf of a -inf its inputs held: made by ``minus_inf`` in the same replay
    # (arithmetic, not a mask), or - ``masked_input`` - before the module, by no mask it knows
    minus_inf: Origin | None = None
    masked_input: bool = False

    @classmethod
    def at(cls, op: str, loc: tuple | None, **fields: Any) -> Origin:
        """``op`` at ``loc`` (``user_location``'s ``(file, line, ...)``, or None: no user line)."""
        return cls(op, *(loc[:2] if loc else (None, None)), **fields)

    def to_dict(self) -> dict[str, Any]:
        found = {"op": self.op, "source": f"{self.file}:{self.line}" if self.file else None, "note": self.note}
        return {k: v for k, v in found.items() if v is not None}


def tensor_state(t: torch.Tensor) -> int:
    """FINITE, MASKED (its only non-finite values are -inf) or BAD (NaN or +inf). A host sync:
    replays only."""
    if not t.is_floating_point() and not t.is_complex():
        return FINITE
    if t.is_complex():
        return FINITE if bool(torch.isfinite(t).all()) else BAD
    if bool(torch.isfinite(t).all()):
        return FINITE
    if bool(torch.isnan(t).any()) or bool((t == math.inf).any()):
        return BAD
    return MASKED


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _stored(t: torch.Tensor) -> torch.Tensor | None:
    """The values a tensor holds: a sparse one's stored values (a sparse batch holding inf is
    bad, not finite); None for what holds none (meta) or is not looked into (nested)."""
    if t.is_meta or t.is_nested:
        return None
    if t.layout == torch.strided:
        return t
    if t.layout == torch.sparse_coo:
        return t._values()
    return t.values() if t.layout in _COMPRESSED else None


def _worst(value: Any) -> int:
    return max((tensor_state(v) for t in iter_tensors(value) if (v := _stored(t)) is not None), default=FINITE)


class FirstBadOp(TorchDispatchMode):
    """Runs each aten op and keeps the first that made NaN or +inf out of inputs without them,
    and the first that made -inf by arithmetic (a mask written by masked_fill is not that)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: Origin | None = None
        self.given: int = FINITE  # the state of the found op's inputs
        self.negative: Origin | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.observe(name, args, kwargs, out, lambda: Origin.at(f"aten.{name}", user_location(sys._getframe(3))))
        return out

    def observe(self, name: str, args: tuple, kwargs: dict | None, out: Any, origin: Callable[[], Origin]) -> None:
        """One op that ran, in order: ``name`` (aten's, or torch's function name: the same for
        the writers and the casts), what it read and made; ``origin`` names it, called only
        for the op kept."""
        if self.found is None and name not in _UNWRITTEN:
            made = _worst(out)
            if made != FINITE:
                # out= is written, not read
                given = _worst((args, {k: v for k, v in (kwargs or {}).items() if k != "out"}))
                if made == BAD and given != BAD:
                    self.found, self.given = origin(), given
                elif (made == MASKED and given == FINITE and name not in _WRITERS and self.negative is None
                      and not _casts_a_mask(name, args, out)):
                    self.negative = origin()

    def result(self) -> Origin | None:
        """The op that made NaN/+inf; else the one whose arithmetic overflowed to -inf (an
        overflow, not a mask); None if neither (a mask written on purpose, or nothing)."""
        if self.found is not None and self.given == MASKED and self.negative is not None:
            where = f" at {self.negative.file}:{self.negative.line}" if self.negative.file else ""
            self.found.note = f"its input held -inf made by {self.negative.op}{where}"
            self.found.minus_inf = self.negative
        elif self.found is not None and self.given == MASKED:
            self.found.masked_input = True
        if self.found is None and self.negative is not None:
            self.negative.note = "it overflowed to -inf: not a mask, which masked_fill/where would write"
            return self.negative
        return self.found


def _casts_a_mask(name: str, args: tuple, out: Any) -> bool:
    """A cast to a low dtype that turned only sentinel values (|x| >= 1e8: -1e9, finfo(float32).min)
    into -inf: a mask cast with the scores, not an overflow (which is values just past the max)."""
    if name != "_to_copy" or not isinstance(out, torch.Tensor) or not isinstance(args[0], torch.Tensor):
        return False
    became = args[0][out == -math.inf]
    return bool(became.numel()) and bool((became.abs() >= _SENTINEL).all())


def _copy(value: Any, *, grad: bool, depth: int = 4) -> Any:
    """Fresh copies of the call's arguments (the replay may write in place); with ``grad``, float
    tensors that required grad become leaves that require it again. Other objects are copied
    with their attributes, a few levels deep - a transformers KV cache passed to every layer
    would otherwise grow by the replay (its tensors carry this step's graph: detached here) -
    except modules and what will not copy."""
    if isinstance(value, torch.Tensor):
        copy = value.detach().clone()
        return copy.requires_grad_(grad and value.requires_grad and copy.is_floating_point())
    if depth == 0 or value is None or isinstance(value, (bool, int, float, str, torch.nn.Module, torch.dtype,
                                                         torch.device, type)):
        return value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_copy(v, grad=grad, depth=depth - 1) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v, grad=grad, depth=depth - 1) for k, v in value.items()}
    if not hasattr(value, "__dict__"):
        return value
    try:
        copy = copy_module.copy(value)
        for key, item in vars(value).items():
            setattr(copy, key, _copy(item, grad=False, depth=depth - 1))
    except Exception:  # an object that will not copy: the replay uses it as it is
        return value
    return copy


def _eager(module: torch.nn.Module) -> torch.nn.Module:
    """A torch.compile'd module's original: replayed eagerly, its ops and lines are the user's."""
    return getattr(module, "_orig_mod", module) if type(module).__name__ == "OptimizedModule" else module


def _failed(exc: Exception, most: int = 160) -> str:
    """Why a replay failed, in one line: the error's first line, cut at a word."""
    message = str(exc).strip()
    text = type(exc).__name__ + (f": {message.splitlines()[0]}" if message else "")
    if len(text) > most:
        text = text[:most].rsplit(" ", 1)[0] + " ..."
    return f"replaying the module failed: {text}"


class _Isolated:
    """Around a replay: the random state and the module's buffers (BatchNorm's running stats)
    come back as they were, and autocast is the one the call ran under."""

    def __init__(self, call: Call) -> None:
        self.call = call

    def __enter__(self) -> None:
        module = self.call.module
        # its modules' attributes too: a forward that counts its calls (a warmup ramp) would count
        # the replay, and the training go on with another count
        self._attributes = attributes_kept(module)
        self._attributes.__enter__()
        self._buffers = [(b, b.detach().clone()) for b in module.buffers()]
        devices = sorted({b.device.index for b in (*module.parameters(), *module.buffers())
                          if b.device.type == "cuda" and b.device.index is not None})
        self._rng = torch.random.fork_rng(devices=devices)
        self._rng.__enter__()
        self._autocast = autocast_contexts(self.call.autocast)
        for ctx in self._autocast:
            ctx.__enter__()
        # compiled code inside the module runs eagerly: a replay never compiles (under a dispatch
        # mode dynamo would mark the user's forward skipped, and fullgraph then fails the run)
        self._stance = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") else None
        if self._stance is not None:
            self._stance.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._stance is not None:
            self._stance.__exit__(None, None, None)
        for ctx in reversed(self._autocast):
            ctx.__exit__(None, None, None)
        self._rng.__exit__(None, None, None)
        with torch.no_grad():
            for buffer, saved in self._buffers:
                buffer.copy_(saved)
        self._attributes.__exit__(None, None, None)


@boundary  # source lines are the module's own: the walk stops here, not in the training loop
def replay_forward(call: Call) -> Origin:
    """Run ``call`` again and name the first op that made a non-finite value."""
    if _worst((call.args, call.kwargs)) == BAD:
        return Origin(note="its inputs already held NaN or +inf: they came from outside the watched modules "
                           "(the batch, or code between modules)", outside=True)
    scan = FirstBadOp()
    try:
        with _Isolated(call), torch.no_grad(), scan:
            _eager(call.module)(*_copy(call.args, grad=False), **_copy(call.kwargs, grad=False))
    except Exception as exc:  # the user's code: a failed replay only loses the op
        return Origin(note=_failed(exc))
    found = scan.result()
    # the replay runs after the forward, whose BatchNorms wrote its batch statistics into their
    # buffers: a buffer counts only where no op made the value (a parameter the forward never writes)
    state = _nonfinite_state(call.module, buffers=found is None or found.op is None)
    if state is not None:  # the ops read it: with NaN/+inf none made them from finite inputs
        found = found or Origin()
        found.state = state
        found.note = found.note or (f"its {state} already held NaN or Inf before this forward (an optimizer step, "
                                    "or a write to the weights)")
    return found or Origin(note="replayed on its inputs the module stayed finite: it depends on state, "
                                "random numbers or inputs changed in place since")


@boundary
def call_site(parent: Call, child: torch.nn.Module, nth: int) -> tuple[str, int] | None:
    """The user's line in ``parent``'s forward that makes its ``nth`` call of ``child`` (a torch
    module such as nn.Linear, whose own ops have no user line): ``parent`` replayed without grad,
    under its autocast, with a pre-hook on ``child``."""
    seen: list[tuple[str, int] | None] = []

    def hook(module: torch.nn.Module, args: Any) -> None:
        loc = user_location(sys._getframe(1))
        seen.append((loc.file, loc.line) if loc else None)

    handle = child.register_forward_pre_hook(hook)
    try:
        with _Isolated(parent), torch.no_grad():
            _eager(parent.module)(*_copy(parent.args, grad=False), **_copy(parent.kwargs, grad=False))
    except Exception:  # the user's code: no line, nothing else lost
        return None
    finally:
        handle.remove()
    return seen[nth] if 0 <= nth < len(seen) else None


def _nonfinite_state(module: torch.nn.Module, *, buffers: bool = True) -> str | None:
    """The first of ``module``'s parameters (and ``buffers``) that holds NaN or Inf, named
    ("parameter weight", "buffer running_var"), or None."""
    kinds = (("parameter", module.named_parameters()), ("buffer", module.named_buffers()))
    for kind, named in kinds[:2 if buffers else 1]:
        for name, t in named:
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"{kind} {name}"
    return None


@dataclass
class GradSpec:
    """What is known of one incoming gradient: which output it belongs to, and its recorded
    magnitudes as (log2 exponent, count) pairs plus its count of zeros."""

    output: int
    hist: Sequence[Sequence[int]]
    zeros: int = 0
    bad: bool = False  # it held NaN/Inf: a replay seeds it with zeros (what it held is not known)


def synthetic_grad(like: torch.Tensor, spec: GradSpec | None, generator: torch.Generator) -> torch.Tensor:
    """A gradient for ``like`` with the recorded distribution of magnitudes (random signs):
    enough to reproduce an overflow or a 0 * inf without keeping the real gradients alive."""
    if spec is not None and spec.bad:
        return torch.zeros_like(like)
    n = like.numel()
    weights = torch.tensor([c for _, c in spec.hist] + [spec.zeros], dtype=torch.float64) if spec else None
    if weights is None or weights.sum() <= 0:
        return torch.ones_like(like)
    exps = torch.tensor([e for e, _ in spec.hist] + [0], dtype=torch.float64)
    pick = torch.multinomial(weights, n, replacement=True, generator=generator)
    mantissa = 1 + torch.rand(n, dtype=torch.float64, generator=generator)
    values = torch.where(pick == len(spec.hist), 0.0, torch.exp2(exps[pick]) * mantissa)
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.float64) * 2 - 1
    return (values * signs).reshape(like.shape).to(like.dtype).to(like.device)


@dataclass
class NodeScan:
    """Autograd nodes created by the replayed forward, with the op and line that made each,
    and the first node whose finite incoming gradients came out non-finite."""

    made_by: dict = field(default_factory=dict)
    found: Origin | None = None

    def made(self, out: Any, origin: Callable[[], tuple[str, Any]]) -> None:
        """Every node a call's output ``out`` brings, down to those made before (linear's inner
        Mm too), as the call's: ``origin()`` is its (op, user location)."""
        made_by, known = self.made_by, None
        stack = [t.grad_fn for t in iter_tensors(out)]
        while stack:
            node = stack.pop()
            if node is None or node in made_by or (not node.next_functions and node.name() == "AccumulateGrad"):
                continue
            if hasattr(node, "_forward_cls"):  # a custom Function's apply, not this op, made it
                continue
            known = known or origin()
            made_by[node] = known
            stack.extend(next_node for next_node, _ in node.next_functions)

    def backward(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], seeds: list[torch.Tensor]) -> None:
        """``torch.autograd.grad`` from ``outputs``, each node of their graph checked (``found``)."""
        handles = [node.register_hook(self.hook(node)) for node in _graph_nodes(outputs)]
        try:
            torch.autograd.grad(outputs, inputs, seeds, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()

    def hook(self, node):
        def check(grad_inputs, grad_outputs):  # a gradient's -inf is an overflow, never a mask
            if self.found is None and _worst(grad_inputs) != FINITE and _worst(grad_outputs) == FINITE:
                op, loc = self.made_by.get(node, (None, None))
                function = getattr(node, "_forward_cls", None)
                if function is not None:  # a custom autograd Function: its apply's line, from the node
                    op, loc = f"{function.__name__}.apply", _created_at(node)
                self.found = Origin.at(node.name(), loc, note=f"from {op}" if op else None)
        return check


class _NodeSources(torch.overrides.TorchFunctionMode):
    """Maps each autograd node the forward creates to the torch function and user line."""

    def __init__(self, scan: NodeScan) -> None:
        super().__init__()
        self.scan = scan

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        frame = sys._getframe(1)
        self.scan.made(out, lambda: (getattr(func, "__name__", str(func)), user_location(frame)))
        return out


_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')


def _created_at(node) -> tuple[str, int] | None:
    """The user's line that created ``node``, from the stack anomaly mode keeps with it: the
    innermost user frame before the replay (ampaudit's own frames end the walk)."""
    for entry in reversed(node.metadata.get("traceback_") or []):
        frame = _FRAME.match(entry)
        if frame is None:
            continue
        kind = classify(frame["file"])
        if kind == "user":
            return frame["file"], int(frame["line"])
        if kind == "ampaudit":
            return None
    return None


@boundary
def replay_backward(call: Call, grads: Sequence[GradSpec], seed: int = 0) -> Origin:
    """Run ``call`` forward again with grad enabled, then backward from gradients shaped like
    the recorded ones; name the first autograd node that turned finite gradients non-finite."""
    scan = NodeScan()
    args, kwargs = _copy(call.args, grad=True), _copy(call.kwargs, grad=True)
    leaves = [t for t in iter_tensors((args, kwargs)) if t.requires_grad]
    params = [p for p in call.module.parameters() if p.requires_grad]
    try:
        # anomaly mode keeps each node's creation stack: a custom Function's line (replays only)
        with _Isolated(call), torch.enable_grad():
            with _NodeSources(scan), torch.autograd.set_detect_anomaly(True, check_nan=False):
                out = _eager(call.module)(*args, **kwargs)
            outputs = [t for t in iter_tensors(out) if t.requires_grad]
            if not outputs:
                return Origin(note="the replayed forward has no output that needs a gradient")
            by_output = {g.output: g for g in grads}
            generator = torch.Generator().manual_seed(seed)
            seeds = [synthetic_grad(t, by_output.get(i), generator) for i, t in enumerate(outputs)]
            scan.backward(outputs, leaves + params, seeds)
    except Exception as exc:  # the user's code: a failed replay only loses the node
        return Origin(note=_failed(exc))
    return scan.found or Origin(note="the replay's gradients stayed finite", cleared=True)


def _graph_nodes(outputs: list[torch.Tensor]) -> list:
    """The autograd nodes behind ``outputs``, each once."""
    seen, stack = set(), [t.grad_fn for t in outputs]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(seen)
