"""A small dtype inference over a script's names: which values hold low precision (fp16/bf16
from autocast or ``.half()``) and which stay fp32 - for AMP422, the region that turns autocast
off but is fed low-precision values.

Read from the source alone, one assignment at a time, in the order the visit meets them:

- a value computed outside every enabled autocast region is fp32 (unless ``.half()``-ed);
- indexing, slicing, a field, a view (the catalog's ``same_values`` / ``passes_values``
  traits) keep their origin's dtype, and so does a helper named for slicing
  (``slice_segments(mel, ...)``);
- ``.float()`` / ``.to(torch.float32)`` give fp32, ``.half()`` / ``.to(torch.float16)`` low;
- a torch op under enabled autocast gives what autocast makes of it, read from the op
  catalog (rules/ops.toml, the data the graph audit reads): its fp16 list low, its fp32
  list (``log10``, the losses, ``softmax``) fp32, anything else the widest input; outside
  autocast, an op gives its widest input;
- a model's forward (a call of a variable: ``model(x)``, ``self.backbone(x)``) under autocast
  gives low precision when it is the one value assigned; the elements of a tuple it returns
  are unknown (a model returns fp32 log-probabilities and masks beside its fp16 features);
- a function's result (imported, or defined at the top level) is unknown: VITS'
  ``spec_to_mel_torch`` ends in a ``log``, which autocast runs in fp32.

Unknown stays unknown (a parameter, a loop variable): it never makes a finding.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable
from functools import cache

from ampaudit.check.lint.facts import BFLOAT16_NAMES, FLOAT16_NAMES
from ampaudit.check.lint.nodes import dotted
from ampaudit.core.catalog import Catalog, builtin_catalog

LOW = "low"
FP32 = "fp32"
Dtype = str | None  # LOW, FP32, or None: unknown

FP32_NAMES = frozenset({"torch.float32", "torch.float", "torch.float64", "torch.double"})
_TO_FP32 = frozenset({"float", "double"})
_TO_LOW = frozenset({"half", "bfloat16"})
_CASTS = _TO_FP32 | _TO_LOW | {"to", "type", "type_as"}
# tensor methods that move a tensor without changing its dtype
_MOVES = frozenset({"cuda", "cpu", "to", "contiguous", "detach", "clone", "pin_memory", "requires_grad_"})
# a helper of the user's that cuts a piece out of its first argument
_SLICING = re.compile(r"slice|segment|crop|narrow|select|gather|index|chunk|split", re.IGNORECASE)


@cache
def _catalog() -> tuple[Catalog, frozenset[str]]:
    catalog = builtin_catalog()
    # what keeps its input's dtype, casts aside (handled first)
    keeps = catalog.trait("same_values", "passes_values") - _CASTS
    return catalog, keeps


def widest(dtypes: Iterable[Dtype]) -> Dtype:
    """Type promotion over the known inputs: fp32 wins; low only when some input is low."""
    seen = set(dtypes)
    return FP32 if FP32 in seen else LOW if LOW in seen else None


class Inference:
    """The dtype of an expression, given the dtypes names hold so far in its scope."""

    def __init__(self, lookup: Callable[[str], Dtype], qualified: Callable[[ast.AST], frozenset[str]],
                 modules: Callable[[str], str | None], function: Callable[[str], bool] = lambda name: False) -> None:
        self.lookup = lookup  # dotted name -> its dtype here
        self.qualified = qualified
        self.modules = modules  # a name -> the torch.nn class it was built from (`criterion`)
        self.function = function  # whether a callee is a function (imported or defined), not a model

    def of(self, node: ast.expr, autocast: bool, single: bool = True) -> Dtype:
        """``node``'s dtype when it is evaluated in (``autocast``) or out of an enabled
        autocast region; ``single``: it is the whole value assigned to one name."""
        kind = node.__class__
        if kind is ast.Name or kind is ast.Attribute:
            name = dotted(node)
            found = self.lookup(name) if name is not None else None
            if found is None and kind is ast.Attribute:
                return self.of(node.value, autocast)  # out.logits: the field of an output
            return found
        if kind is ast.Subscript or kind is ast.Starred:
            return self.of(node.value, autocast)
        if kind is ast.UnaryOp:
            return self.of(node.operand, autocast)
        if kind is ast.BinOp:
            if node.op.__class__ is ast.MatMult and autocast:
                return LOW
            return widest((self.of(node.left, autocast), self.of(node.right, autocast)))
        if kind is ast.IfExp:
            body, orelse = self.of(node.body, autocast), self.of(node.orelse, autocast)
            return body if body == orelse else None
        if kind is ast.Call:
            return self._call(node, autocast, single)
        return None

    def _call(self, node: ast.Call, autocast: bool, single: bool) -> Dtype:
        func = node.func
        method = func.attr if func.__class__ is ast.Attribute else None
        inputs = list(node.args) + [k.value for k in node.keywords if k.arg is not None]
        receiver: Dtype = None
        if method is not None:
            if method in _TO_FP32:
                return FP32
            if method in _TO_LOW:
                return LOW
            receiver = self.of(func.value, autocast)
            if method == "to":
                target = self._dtype_argument(node)
                return target if target is not None else receiver
            if method == "type_as" and node.args:
                return self.of(node.args[0], autocast)
            if method in _MOVES:
                return receiver
        names = self.qualified(func)
        torch_op = any(n.startswith("torch.") for n in names) and not any(n.startswith("torch.nn.") and
                                                                        n.rsplit(".", 1)[-1][:1].isupper()
                                                                        for n in names)
        catalog, keeps = _catalog()
        module = self.modules(dotted(func) or "")
        if module is not None and module not in catalog.modules:
            module = None  # nn.DataParallel(net), nn.Sequential(...): a model, not one op
        if torch_op or receiver is not None or module is not None:
            if module is not None:
                kind = catalog.modules.get(module)
            else:
                last = next(iter(sorted(names)), None) if names else None
                kind = catalog.canonical_kind((last or method or "").rsplit(".", 1)[-1])
            args = [self.of(a, autocast) for a in inputs]
            if receiver is not None and module is None and not torch_op:
                args.insert(0, receiver)  # a tensor method: x.log10(), x.softmax(-1)
            if kind in keeps:
                return args[0] if args else None
            policy = catalog.lookup(kind) if kind is not None else None
            if autocast and policy is not None and policy.autocast == "fp16":
                return LOW
            if autocast and policy is not None and policy.autocast == "fp32":
                return FP32
            found = widest(args)
            return found if found is not None or autocast else FP32  # torch.zeros(...) outside: fp32
        # a call of the user's
        callee = (dotted(func) or "").rsplit(".", 1)[-1]
        if _SLICING.search(callee) and inputs:
            return self.of(inputs[0], autocast)
        if autocast:
            return LOW if single and not self.function(dotted(func) or "") else None
        args = [self.of(a, autocast) for a in inputs]
        return None if LOW in args else FP32

    def _dtype_argument(self, node: ast.Call) -> Dtype:
        """The dtype ``.to(...)`` casts to, when one is named."""
        for value in [*node.args, *(k.value for k in node.keywords if k.arg == "dtype")]:
            names = self.qualified(value)
            if names & (FLOAT16_NAMES | BFLOAT16_NAMES):
                return LOW
            if names & FP32_NAMES:
                return FP32
        return None
