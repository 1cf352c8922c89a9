"""One libcst visit of a training script, collecting the facts every lint rule needs.

The visit records each call (with its qualified name, receiver, enclosing function, loop,
autocast block and statement), each assignment of a call result, each autocast block and
the few other shapes rules look at. Rules are then plain functions over these facts -
the file is parsed and walked once, whatever the number of rules.

Scopes: each function body (nested functions separately) and the module's top level.
Rules compare events of one scope only, so two unrelated functions never combine into a
finding.

Paths: each call also records the conditions it runs under (``guards``: the ``if`` /
``else`` branches and conditional expressions around it, and the early ``return`` /
``continue`` before it). Which of them switch AMP on or off is decided after the visit,
when every scaler and ``enabled=`` flag of the file is known (check/lint/guards.py).
"""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import libcst as cst
import libcst.metadata as meta

from ampaudit.core.dtypes import BFLOAT16, FLOAT16, LowDtype

GRAD_SCALERS = frozenset({"torch.amp.GradScaler", "torch.cuda.amp.GradScaler", "torch.GradScaler",
                          "torch.amp.grad_scaler.GradScaler", "torch.cuda.amp.grad_scaler.GradScaler"})
AUTOCASTS = {  # qualified name -> the device it implies (None: given as an argument)
    "torch.autocast": None, "torch.amp.autocast": None, "torch.amp.autocast_mode.autocast": None,
    "torch.cuda.amp.autocast": "cuda", "torch.cpu.amp.autocast": "cpu",
}
FLOAT16_NAMES = frozenset({"torch.float16", "torch.half"})
BFLOAT16_NAMES = frozenset({"torch.bfloat16"})


@dataclass(eq=False)
class Scope:
    kind: str  # "module" or "function"
    name: str
    node: cst.CSTNode


@dataclass(eq=False)
class Autocast:
    node: cst.With
    item: cst.Call
    device: str | None  # "cuda", "cpu", or None when not a literal
    dtype: LowDtype | None  # None when not known statically
    scope: Scope
    line: int  # the `with` statement
    column: int
    end: int  # last line of the block
    enabled: bool = True  # False for autocast(enabled=False): a region where AMP is off
    dtype_text: str | None = None  # the dtype argument as written, when not a literal dtype


# A condition a statement runs under: the test expression and whether it held (True: the
# ``if`` body, or after an early exit from its ``else``; False: the ``else``, or after an
# early exit from the body).
Guard = tuple[cst.BaseExpression, bool]


@dataclass(eq=False)
class Call:
    node: cst.Call
    names: frozenset[str]  # qualified names of the callee ({} for methods on local objects)
    method: str | None  # attribute name for `x.method(...)`
    receiver: str | None  # dotted text of `x` in `x.method(...)`, when it is a plain name chain
    scope: Scope
    loop: cst.CSTNode | None  # innermost for/while around the call, in this scope
    autocast: Autocast | None  # innermost autocast block around the call, in this scope
    statement: cst.CSTNode | None  # the simple statement line holding the call
    line: int
    column: int  # 1-based
    feeds_backward: bool = False  # `x.method(...).backward()`: the call whose result is backward-ed
    guards: tuple[Guard, ...] = ()  # outermost first
    in_scale_loss: bool = False  # inside apex's `with amp.scale_loss(loss, opt) as scaled:`
    block_exits: bool = False  # its block ends in return/raise/continue/break: what follows never sees it
    compat: bool = False  # in a fallback for old torch: try/except ImportError, or under a version check

    @property
    def disabled(self) -> bool:
        """``enabled=False`` written out: a GradScaler or autocast that does nothing."""
        return _is_false(self.kwarg("enabled"))

    @property
    def maybe_enabled(self) -> bool:
        """``enabled=<expression>``: on or off depending on the run."""
        enabled = self.kwarg("enabled")
        return enabled is not None and not (isinstance(enabled, cst.Name) and enabled.value in ("True", "False"))

    def kwarg(self, keyword: str) -> cst.BaseExpression | None:
        return next((a.value for a in self.node.args if a.keyword is not None and a.keyword.value == keyword), None)

    def arg(self, index: int, keyword: str | None = None) -> cst.BaseExpression | None:
        positional = [a for a in self.node.args if a.keyword is None and a.star == ""]
        if keyword is not None:
            for a in self.node.args:
                if a.keyword is not None and a.keyword.value == keyword:
                    return a.value
        return positional[index].value if index < len(positional) else None


@dataclass(eq=False)
class Assignment:
    target: str  # dotted text: "scaler", "self.scaler"
    call: Call


@dataclass(eq=False)
class ClassDef:
    node: cst.ClassDef
    bases: frozenset[str]  # qualified names of the bases
    decorated_methods: dict[str, frozenset[str]]  # method name -> qualified names of its decorators
    line: int
    column: int


@dataclass(eq=False)
class Import:
    node: cst.Import | cst.ImportFrom
    module: str  # "torch.cuda.amp" for `from torch.cuda.amp import x` and `import torch.cuda.amp`
    names: tuple[tuple[str, str], ...]  # (imported name, bound alias) for `from m import n as a`
    line: int
    column: int
    compat: bool = False  # in a fallback for old torch (see Call.compat)


@dataclass(eq=False)
class Reference:
    """An attribute such as ``torch.cuda.amp.autocast`` used as a value (not called):
    ``ac = torch.cuda.amp.autocast``, ``partial(torch.cuda.amp.GradScaler, ...)``."""

    node: cst.Attribute
    names: frozenset[str]
    line: int
    column: int
    compat: bool = False


@dataclass(eq=False)
class Decorator:
    node: cst.Decorator
    names: frozenset[str]  # qualified names of the decorator (its callee, if called)
    line: int
    column: int


@dataclass(eq=False)
class Comparison:
    node: cst.Comparison
    line: int
    column: int


@dataclass(eq=False)
class BinaryOp:
    node: cst.BinaryOperation
    line: int
    column: int


@dataclass
class ScriptFacts:
    path: str
    source: str
    module: cst.Module
    calls: list[Call] = field(default_factory=list)
    assignments: list[Assignment] = field(default_factory=list)
    autocasts: list[Autocast] = field(default_factory=list)
    classes: list[ClassDef] = field(default_factory=list)
    imports: list[Import] = field(default_factory=list)
    decorators: list[Decorator] = field(default_factory=list)
    binary_ops: list[BinaryOp] = field(default_factory=list)
    amp_references: list[Reference] = field(default_factory=list)
    scale_comparisons: list[Comparison] = field(default_factory=list)  # == / != with a get_scale() side
    low_names: dict[tuple[int, str], int] = field(default_factory=dict)  # (scope id, name) -> line: holds fp16/bf16
    scaled_values: dict[tuple[int, str], str] = field(default_factory=dict)  # `loss = scaler.scale(loss)`: -> scaler
    enabled_flags: set[str] = field(default_factory=set)  # dotted names passed as enabled= to AMP APIs
    local_backward_classes: set[str] = field(default_factory=set)  # classes defined here with a backward()
    instances: dict[str, str] = field(default_factory=dict)  # name -> local class it was built from
    positions: Mapping[cst.CSTNode, meta.CodeRange] = field(default_factory=dict, repr=False)
    names: dict[cst.CSTNode, frozenset[str]] = field(default_factory=dict, repr=False)
    imports_map: ImportMap = field(default_factory=lambda: ImportMap({}), repr=False)
    _references: dict[str, list[cst.Name]] = field(default_factory=dict, repr=False)
    _scalers: dict[int, frozenset[str]] = field(default_factory=dict, repr=False)  # per scope, once
    _by_scope: dict[Scope, list[Call]] | None = field(default=None, repr=False)  # calls_in
    amp_states: dict[Call, tuple[str | None, str | None]] = field(default_factory=dict, repr=False)  # guards.py
    _line_starts: list[int] = field(default_factory=list, repr=False)

    # -- queries --------------------------------------------------------------------------
    def calls_to(self, names: Iterable[str]) -> Iterator[Call]:
        wanted = frozenset(names)
        return (c for c in self.calls if c.names & wanted)

    def method_calls(self, method: str, scope: Scope | None = None) -> Iterator[Call]:
        return (c for c in (self.calls if scope is None else self.calls_in(scope)) if c.method == method)

    def calls_in(self, scope: Scope) -> list[Call]:
        """The calls of one function (or the module's top level), in order."""
        return self._grouped().get(scope, [])

    def scopes(self) -> list[Scope]:
        """The scopes that hold calls, in the order their first call appears."""
        return list(self._grouped())

    def _grouped(self) -> dict[Scope, list[Call]]:
        # Rules ask per scope, many times: grouped once, so the lint stays linear in the
        # number of scopes instead of scanning every call for each one.
        if self._by_scope is None:
            self._by_scope = {}
            for call in self.calls:
                self._by_scope.setdefault(call.scope, []).append(call)
        return self._by_scope

    def assigned(self, names: Iterable[str], scope: Scope | None = None) -> list[Assignment]:
        wanted = frozenset(names)
        return [a for a in self.assignments if a.call.names & wanted and (scope is None or a.call.scope is scope
                                                                          or a.call.scope.kind == "module")]

    def scalers(self, scope: Scope) -> frozenset[str]:
        """Names holding a GradScaler in ``scope``: assigned one here or at module level, or
        used as one (``x.scale(loss).backward()``). ``GradScaler(enabled=False)`` is not one.
        Several rules ask, per scope: computed once."""
        if id(scope) not in self._scalers:
            names = {a.target for a in self.assigned(GRAD_SCALERS, scope) if not a.call.disabled}
            names |= {c.receiver for c in self.method_calls("scale", scope) if c.receiver and c.feeds_backward}
            # built elsewhere (a parameter, a helper's result, self.scaler from __init__): known by
            # its use - unscale_() is GradScaler's alone; step/update/scale on a scaler-named object
            for c in self.calls_in(scope):
                if c.receiver and (c.method == "unscale_" or (
                        c.method in ("scale", "step", "update", "get_scale") and _SCALER_NAME.search(c.receiver))):
                    names.add(c.receiver)
            self._scalers[id(scope)] = frozenset(names)
        return self._scalers[id(scope)]

    def qualified(self, node: cst.CSTNode) -> frozenset[str]:
        """Qualified names of any expression (``torch.float16``, an imported alias...)."""
        if node not in self.names:
            self.names[node] = self.imports_map.qualify(node)
        return self.names[node]

    def references(self, name: str) -> list[cst.CSTNode]:
        """The nodes that read ``name``, a name an import of an old AMP module binds (those are
        tracked; the lint never sees a rebinding of them)."""
        return list(self._references.get(name, ()))

    def offset(self, line: int, column: int) -> int:
        """Character offset of a libcst position (1-based line, 0-based column)."""
        return self._line_starts[line - 1] + column

    def lines(self, node: cst.CSTNode) -> tuple[int, int]:
        """First and last line of a node."""
        rng = self.positions[node]
        return rng.start.line, rng.end.line

    def span(self, node: cst.CSTNode) -> tuple[int, int]:
        rng = self.positions[node]
        return self.offset(rng.start.line, rng.start.column), self.offset(rng.end.line, rng.end.column)

    def text(self, node: cst.CSTNode) -> str:
        start, end = self.span(node)
        return self.source[start:end]


_EMPTY = cst.Module([])  # renders a node's code


def unwrap_cast(node: cst.BaseExpression) -> cst.BaseExpression:
    """The value inside ``typing.cast(T, value)`` (a type checker's wrapper), else ``node``."""
    if isinstance(node, cst.Call) and len(node.args) == 2 and (dotted(node.func) or "").rsplit(".", 1)[-1] == "cast":
        return node.args[1].value
    return node


def dotted(node: cst.BaseExpression | None) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


class _Collector(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (meta.PositionProvider,)

    def __init__(self, facts: ScriptFacts) -> None:
        super().__init__()
        self.facts = facts
        self.scope = Scope("module", "<module>", facts.module)
        self.loops: list[cst.CSTNode | None] = [None]
        self.autocasts: list[Autocast | None] = [None]
        self.statements: list[cst.CSTNode | None] = [None]
        self.saved: list[tuple] = []  # enclosing scopes' state while inside a function
        self.backward_receivers: set[cst.Call] = set()  # calls whose result is .backward()-ed
        self.by_node: dict[cst.Call, Call] = {}
        self.guards: list[Guard] = []
        self.blocks: list[cst.CSTNode] = [facts.module]  # the statement lists we are in
        self.block_exits: list[bool] = [False]
        self.function_bodies: set[cst.BaseSuite] = set()
        self.exits: list[cst.CSTNode] = []  # per early-exit guard: the block whose end drops it
        self.contexts: dict[str, cst.Call] = {}  # `ctx = torch.autocast(...)`: name -> the call
        self.scale_loss: list[bool] = [False]
        self.compat: list[bool] = [False]  # inside a try/except that falls back for old torch
        self.try_compat: list[bool] = []
        self.version_tests: dict[cst.CSTNode, bool] = {}
        # names an import of an old AMP module binds: their reads are collected (references)
        self.tracked = {name for name, target in facts.imports_map.bound.items()
                        if target.startswith(("torch.cuda.amp", "torch.cpu.amp"))}
        self.not_reads: set[int] = set()  # Name nodes that are attributes, keywords, import aliases

    # -- bookkeeping ----------------------------------------------------------------------
    def _names(self, node: cst.CSTNode) -> frozenset[str]:
        return self.facts.qualified(node)

    def _pos(self, node: cst.CSTNode) -> tuple[int, int]:
        rng = self.get_metadata(meta.PositionProvider, node)
        return rng.start.line, rng.start.column + 1

    # -- scopes and blocks ----------------------------------------------------------------
    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.saved.append((self.scope, self.loops, self.autocasts, self.guards, self.scale_loss))
        self.scope = Scope("function", node.name.value, node)
        self.loops, self.autocasts, self.guards, self.scale_loss = [None], [None], [], [False]
        self.function_bodies.add(node.body)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.scope, self.loops, self.autocasts, self.guards, self.scale_loss = self.saved.pop()

    # -- paths: the conditions a statement runs under ------------------------------------
    def visit_If_body(self, node: cst.If) -> None:
        self.guards.append((node.test, True))

    def leave_If_body(self, node: cst.If) -> None:
        self.guards.pop()

    def visit_If_orelse(self, node: cst.If) -> None:
        self.guards.append((node.test, False))

    def leave_If_orelse(self, node: cst.If) -> None:
        self.guards.pop()

    def leave_If(self, original_node: cst.If) -> None:
        # `if not use_amp: loss.backward(); continue` - the rest of the block runs only
        # when the test was false (and vice versa for an else that exits).
        body_exits = _exits(original_node.body)
        orelse = original_node.orelse
        else_exits = isinstance(orelse, cst.Else) and _exits(orelse.body)
        if body_exits != else_exits:
            self.guards.append((original_node.test, not body_exits))
            self.exits.append(self.blocks[-1])

    # -- fallbacks for old torch: try/except ImportError, version checks --------------------
    def visit_Try(self, node: cst.Try) -> None:
        self.try_compat.append(any(_catches_compat(h) for h in node.handlers))

    def leave_Try(self, original_node: cst.Try) -> None:
        self.try_compat.pop()

    def visit_Try_body(self, node: cst.Try) -> None:
        self.compat.append(self.compat[-1] or self.try_compat[-1])

    def leave_Try_body(self, node: cst.Try) -> None:
        self.compat.pop()

    def visit_ExceptHandler(self, node: cst.ExceptHandler) -> None:
        self.compat.append(self.compat[-1] or _catches_compat(node))

    def leave_ExceptHandler(self, original_node: cst.ExceptHandler) -> None:
        self.compat.pop()

    def _in_compat(self) -> bool:
        if self.compat[-1]:
            return True
        for test, _ in self.guards:
            if test not in self.version_tests:
                self.version_tests[test] = bool(_VERSION_TEST.search(_EMPTY.code_for_node(test)))
            if self.version_tests[test]:
                return True
        return False

    def visit_Comparison(self, node: cst.Comparison) -> None:
        # `scaler.get_scale() != before`: kept for the skip-check rule; the sides are read there
        if len(node.comparisons) == 1 and isinstance(node.comparisons[0].operator, (cst.NotEqual, cst.Equal)):
            sides = (node.left, node.comparisons[0].comparator)
            if any(isinstance(x, cst.Call) and isinstance(x.func, cst.Attribute) and x.func.attr.value == "get_scale"
                   for x in sides):
                line, column = self._pos(node)
                self.facts.scale_comparisons.append(Comparison(node, line, column))

    def visit_Name(self, node: cst.Name) -> None:
        if node.value in self.tracked and id(node) not in self.not_reads:
            self.facts._references.setdefault(node.value, []).append(node)

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None:
            self.not_reads.add(id(node.keyword))

    def visit_ImportAlias(self, node: cst.ImportAlias) -> bool:
        return False  # the names an import binds are not reads of them

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.not_reads.add(id(node.attr))
        if node.attr.value in _AMP_ATTRIBUTES:
            line, column = self._pos(node)
            self.facts.amp_references.append(Reference(node, self._names(node), line, column, self._in_compat()))

    # `a if test else b`: the same guards as an if statement (both nodes have test/body/orelse)
    visit_IfExp_body, leave_IfExp_body = visit_If_body, leave_If_body
    visit_IfExp_orelse, leave_IfExp_orelse = visit_If_orelse, leave_If_orelse

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self.blocks.append(node)
        # A branch that returns (or a block inside one) is left before the code after it;
        # a function's own body returning is not an early exit.
        inside = node not in self.function_bodies and (self.block_exits[-1] or _exits(node))
        self.block_exits.append(inside)

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock) -> None:
        while self.exits and self.exits[-1] is original_node:
            self.guards.pop()
            self.exits.pop()
        self.blocks.pop()
        self.block_exits.pop()

    def visit_For(self, node: cst.For) -> None:
        self.loops.append(node)

    def leave_For(self, original_node: cst.For) -> None:
        self.loops.pop()

    def visit_While(self, node: cst.While) -> None:
        self.loops.append(node)

    def leave_While(self, original_node: cst.While) -> None:
        self.loops.pop()

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self.statements.append(node)

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine) -> None:
        self.statements.pop()

    def visit_With(self, node: cst.With) -> None:
        block = None
        scale_loss = self.scale_loss[-1]
        for item in node.items:
            call = item.item
            if not isinstance(call, cst.Call) or self._autocast_device(call.func) is False:
                bound = dotted(call.func if isinstance(call, cst.Call) else call)  # `with ctx:` / `with ctx():`
                call = self.contexts.get(bound or "")
            if isinstance(call, cst.Call) and (device := self._autocast_device(call.func)) is not False:
                block = self._autocast(node, call, device)
            elif isinstance(item.item, cst.Call) and isinstance(item.item.func, cst.Attribute) \
                    and item.item.func.attr.value == "scale_loss":
                scale_loss = True  # apex: backward inside runs on the scaled loss
        self.autocasts.append(block or self.autocasts[-1])
        self.scale_loss.append(scale_loss)

    def leave_With(self, original_node: cst.With) -> None:
        self.autocasts.pop()
        self.scale_loss.pop()

    def _autocast(self, node: cst.With, call: cst.Call, device: str | None) -> Autocast:
        args = [a for a in call.args if a.keyword is None]
        keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
        if device is None:
            value = keywords.get("device_type", args[0].value if args else None)
            device = value.evaluated_value if isinstance(value, cst.SimpleString) else None
        dtype_node = keywords.get("dtype", args[1].value if device is not None and len(args) > 1 else None)
        dtype = dtype_text = None
        if dtype_node is not None:
            names = self._names(dtype_node)
            dtype = FLOAT16 if names & FLOAT16_NAMES else BFLOAT16 if names & BFLOAT16_NAMES else None
            dtype_text = None if dtype else _EMPTY.code_for_node(dtype_node)
        elif device == "cuda":
            dtype = FLOAT16  # CUDA autocast's default
        elif device == "cpu":
            dtype = BFLOAT16
        line, column = self._pos(node)
        end = self.get_metadata(meta.PositionProvider, node).end.line
        block = Autocast(node, call, device, dtype, self.scope, line, column, end,
                         enabled=not _is_false(keywords.get("enabled")), dtype_text=dtype_text)
        self.facts.autocasts.append(block)
        return block

    # -- events ---------------------------------------------------------------------------
    def visit_Call(self, node: cst.Call) -> None:
        method = receiver = None
        if isinstance(node.func, cst.Attribute):
            method = node.func.attr.value
            receiver = dotted(node.func.value)
        line, column = self._pos(node)
        # x.scale(loss).backward(): the outer call is visited first; mark the inner one, so
        # that scalers are also found by use.
        if method == "backward" and isinstance(node.func, cst.Attribute) and isinstance(node.func.value, cst.Call):
            self.backward_receivers.add(unwrap_cast(node.func.value))
        call = Call(node, self._names(node.func), method, receiver, self.scope, self.loops[-1],
                    self.autocasts[-1], self.statements[-1], line, column,
                    feeds_backward=node in self.backward_receivers, guards=tuple(self.guards),
                    in_scale_loss=self.scale_loss[-1], block_exits=self.block_exits[-1], compat=self._in_compat())
        enabled = call.kwarg("enabled")
        if enabled is not None and call.names & _AMP_SWITCHES:
            self.facts.enabled_flags.update(_flag_names(enabled))
        self.facts.calls.append(call)
        self.by_node[node] = call

    def leave_Assign(self, original_node: cst.Assign) -> None:
        value = original_node.value
        block = self.autocasts[-1]
        # a value computed under enabled autocast, or cast with .half(), is low precision
        low = (block is not None and block.enabled) or (
            isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value == "half")
        scaled = unwrap_cast(value)
        scaler = dotted(scaled.func.value) if isinstance(scaled, cst.Call) and isinstance(scaled.func, cst.Attribute) \
            and scaled.func.attr.value == "scale" else None
        for target in original_node.targets:
            for element in _targets(target.target):
                bound = dotted(element)
                if bound and low:
                    self.facts.low_names.setdefault((id(self.scope), bound), self._pos(original_node)[0])
                elif bound:
                    self.facts.low_names.pop((id(self.scope), bound), None)  # reassigned in fp32
            name = dotted(target.target)
            if not name:
                continue
            if scaler:
                self.facts.scaled_values[(id(self.scope), name)] = scaler
            else:
                self.facts.scaled_values.pop((id(self.scope), name), None)
            context = self._autocast_in(value)
            if context is not None:
                self.contexts[name] = context
            call = value if isinstance(value, cst.Call) else _conditional_call(value)
            if call is not None and call in self.by_node:
                self.facts.assignments.append(Assignment(name, self.by_node[call]))
                callee = dotted(call.func)
                if callee in self.facts.local_backward_classes:
                    self.facts.instances[name] = callee

    def _autocast_in(self, value: cst.BaseExpression) -> cst.Call | None:
        """The autocast call a context variable holds: ``torch.autocast(...)``, one side of
        ``nullcontext() if cpu else torch.autocast(...)``, ``partial(torch.autocast, ...)``, or
        the uncalled function (``accelerator.autocast if amp else nullcontext``)."""
        for candidate in (value, *(getattr(value, side, None) for side in ("body", "orelse"))):
            if isinstance(candidate, (cst.Name, cst.Attribute)) and self._autocast_device(candidate) is not False:
                return cst.Call(func=candidate)  # `ctx = accelerator.autocast if amp else nullcontext`
            if not isinstance(candidate, cst.Call):
                continue
            if self._autocast_device(candidate.func) is not False:
                return candidate
            if "functools.partial" in self._names(candidate.func) and candidate.args \
                    and self._autocast_device(candidate.args[0].value) is not False:
                return candidate.with_changes(func=candidate.args[0].value, args=candidate.args[1:])
        return None

    def _autocast_device(self, func: cst.BaseExpression) -> str | bool | None:
        """The device an autocast callee implies (None: an argument, or a framework's own
        ``x.autocast``); False when ``func`` is no autocast."""
        for name in self._names(func):
            if name in AUTOCASTS:
                return AUTOCASTS[name]
        if isinstance(func, cst.Attribute) and func.attr.value == "autocast":
            return None  # accelerator.autocast(), a trainer's own: AMP of some dtype
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        bases = frozenset(n for base in node.bases for n in self._names(base.value))
        methods = {}
        for stmt in node.body.body:
            if isinstance(stmt, cst.FunctionDef):
                methods[stmt.name.value] = frozenset(
                    n for d in stmt.decorators for n in self._names(
                        d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator))
        if "backward" in methods and not bases & _AUTOGRAD_FUNCTIONS:
            self.facts.local_backward_classes.add(node.name.value)  # its backward is not torch's
        line, column = self._pos(node)
        self.facts.classes.append(ClassDef(node, bases, methods, line, column))

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.module is None or isinstance(node.names, cst.ImportStar):
            return
        line, column = self._pos(node)
        module = "." * len(node.relative) + _EMPTY.code_for_node(node.module)
        names = tuple((_EMPTY.code_for_node(a.name), _EMPTY.code_for_node(a.asname.name) if a.asname else
                       _EMPTY.code_for_node(a.name)) for a in node.names)
        self.facts.imports.append(Import(node, module, names, line, column, self._in_compat()))

    def visit_Import(self, node: cst.Import) -> None:
        line, column = self._pos(node)
        for alias in node.names:
            name = _EMPTY.code_for_node(alias.name)
            bound = _EMPTY.code_for_node(alias.asname.name) if alias.asname else name.split(".")[0]
            self.facts.imports.append(Import(node, name, ((name, bound),), line, column, self._in_compat()))

    def visit_Decorator(self, node: cst.Decorator) -> None:
        target = node.decorator.func if isinstance(node.decorator, cst.Call) else node.decorator
        line, column = self._pos(node)
        self.facts.decorators.append(Decorator(node, self._names(target), line, column))

    def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
        if isinstance(node.operator, (cst.Add, cst.Subtract)):
            line, column = self._pos(node)
            self.facts.binary_ops.append(BinaryOp(node, line, column))


def skeleton(source: str, relevant: re.Pattern[str], tree: ast.Module | None = None) -> str:
    """``source`` with the top-level functions and classes that ``relevant`` (what the rules
    read) does not match blanked out, line for line. ``tree``: ``source`` already parsed.

    Parsing and position tracking in libcst cost a pass over every node; model code (layers,
    datasets, configs) holds nothing the protocol rules read, so it is not parsed. Kept lines
    are unchanged, so every line, column and offset stays valid for the original.
    """
    tree = tree if tree is not None else _parse(source)
    if tree is None:
        return source  # libcst reports the syntax error
    lines = source.splitlines(keepends=True)
    blank = False
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.end_lineno is None:
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        if relevant.search("".join(lines[first:node.end_lineno])):
            continue
        for index in range(first, node.end_lineno):
            ending = "\r\n" if lines[index].endswith("\r\n") else "\n" if lines[index].endswith("\n") else ""
            lines[index] = ending
        blank = True
    return "".join(lines) if blank else source


def collect(path: str, source: str, relevant: re.Pattern[str] | None = None) -> ScriptFacts:
    """Parse ``source`` once and gather its facts; raises libcst.ParserSyntaxError.

    ``relevant``: what the rules read (``RuleRegistry.read_pattern``); top-level functions
    and classes it does not match are skipped. None parses everything."""
    tree = _parse(source)  # read once, for the skip and the import map
    imports_map = ImportMap.of(tree)
    kept = skeleton(source, relevant, tree) if relevant is not None else source
    del tree  # a large file's ast must not stay alive beside its libcst tree
    module = cst.parse_module(kept)
    facts = ScriptFacts(path, source, module, imports_map=imports_map)
    starts, offset = [], 0
    for line in source.splitlines(keepends=True):
        starts.append(offset)
        offset += len(line)
    starts.append(offset)
    facts._line_starts = starts
    wrapper = meta.MetadataWrapper(module, unsafe_skip_copy=True)
    wrapper.visit(_Collector(facts))
    facts.positions = wrapper.resolve(meta.PositionProvider)  # computed once, for every node
    return facts


_AMP_SWITCHES = GRAD_SCALERS | frozenset(AUTOCASTS)
_SCALER_NAME = re.compile(r"(^|[._])(grad_|amp_|loss_|amp_grad_|d_|g_)?scaler(_\w+)?$", re.IGNORECASE)
_AUTOGRAD_FUNCTIONS = frozenset({"torch.autograd.Function", "torch.autograd.function.Function"})
_EXITS = (cst.Return, cst.Continue, cst.Break, cst.Raise)
_COMPAT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError", "AttributeError"})
# `if version.parse(torch.__version__) < ...`, `TORCH_2_4`, `is_torch_greater_or_equal(...)`,
# `hasattr(torch.amp, "GradScaler")`: code chosen by the installed torch's version.
_VERSION_TEST = re.compile(r"version|TORCH_\d|hasattr\(\s*torch", re.IGNORECASE)
_AMP_ATTRIBUTES = frozenset({"autocast", "GradScaler", "custom_fwd", "custom_bwd"})


def _parse(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except SyntaxError:  # libcst reports it, with its position
        return None


def _is_false(value: cst.BaseExpression | None) -> bool:
    return isinstance(value, cst.Name) and value.value == "False"


def _catches_compat(handler: cst.ExceptHandler) -> bool:
    """``except ImportError`` / ``except (ImportError, AttributeError)``: a fallback for an
    API an older (or newer) torch lacks."""
    kind = handler.type
    if kind is None:
        return False
    names = [kind] if not isinstance(kind, cst.Tuple) else [e.value for e in kind.elements]
    return any((dotted(n) or "").rsplit(".", 1)[-1] in _COMPAT_ERRORS for n in names)


def _exits(block: cst.BaseSuite) -> bool:
    """Whether a block always leaves its enclosing block: it ends in return/continue/break/raise."""
    body = block.body
    if not body:
        return False
    last = body[-1]
    if isinstance(last, cst.SimpleStatementLine):
        return isinstance(last.body[-1], _EXITS)
    return isinstance(last, _EXITS)


def _flag_names(expr: cst.BaseExpression) -> set[str]:
    """The names an ``enabled=`` expression reads: ``use_amp``, ``args.amp``, and each side of
    ``dtype == "float16"`` or ``not x``."""
    name = dotted(expr)
    if name:
        return {name}
    found: set[str] = set()
    for child in expr.children:
        if isinstance(child, cst.BaseExpression):
            found |= _flag_names(child)
        elif isinstance(child, (cst.ComparisonTarget,)):
            found |= _flag_names(child.comparator)
    return found


def _targets(target: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The names an assignment binds: ``a``, ``self.a``, each of ``a, b = ...``."""
    if isinstance(target, (cst.Tuple, cst.List)):
        return [t for e in target.elements for t in _targets(e.value)]
    return [target]


def _conditional_call(value: cst.BaseExpression) -> cst.Call | None:
    """The call in ``Call(...) if cond else None`` (either side), which still builds the value."""
    if isinstance(value, cst.IfExp):
        for side in (value.body, value.orelse):
            if isinstance(side, cst.Call):
                return side
    return None


class ImportMap:
    """What each imported name stands for: ``F`` -> ``torch.nn.functional``, ``amp`` ->
    ``torch.cuda.amp``, ``autocast`` -> ``torch.cuda.amp.autocast``. Read with ``ast`` from
    every import in the file (module level, functions, ``try`` blocks alike) - the lint only
    asks about torch's, apex's and the frameworks' names, which scripts do not rebind - so
    no scope analysis is needed: that was most of the lint's time."""

    def __init__(self, bound: dict[str, str]) -> None:
        self.bound = bound

    @classmethod
    def of(cls, tree: ast.Module | None) -> ImportMap:
        bound: dict[str, str] = {}
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        root = alias.name.split(".")[0]
                        bound.setdefault(root, root)
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                module = "." * node.level + node.module
                for alias in node.names:
                    if alias.name != "*":
                        bound[alias.asname or alias.name] = f"{module}.{alias.name}"
        return cls(bound)

    def qualify(self, node: cst.CSTNode) -> frozenset[str]:
        """``{"torch.cuda.amp.autocast"}`` for ``amp.autocast`` after ``from torch.cuda import
        amp``; a name nothing imports keeps its own spelling (``scaler.step``)."""
        name = dotted(node) if isinstance(node, (cst.Name, cst.Attribute)) else None
        if name is None:
            return frozenset()
        root, dot, rest = name.partition(".")
        target = self.bound.get(root)
        if target is None:
            return frozenset({f"builtins.{name}" if name in _BUILTINS else name})
        return frozenset({target + dot + rest})


_BUILTINS = frozenset(dir(builtins))
