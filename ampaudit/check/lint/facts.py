"""One ``ast`` visit of a training script, collecting the facts every lint rule needs.

The visit records each call (with its qualified name, receiver, enclosing function, loop,
autocast block and statement), each assignment of a call result, each autocast block and
the few other shapes rules look at. Rules are then plain functions over these facts -
the file is parsed and walked once, whatever the number of rules. Top-level functions and
classes that mention nothing any rule reads are not visited at all.

Scopes: each function body (nested functions separately) and the module's top level.
Rules compare events of one scope only, so two unrelated functions never combine into a
finding.

Paths: each call also records the conditions it runs under (``guards``: the ``if`` /
``else`` branches and conditional expressions around it, and the early ``return`` /
``continue`` before it). Which of them switch AMP on or off is decided after the visit,
when every scaler and ``enabled=`` flag of the file is known (check/lint/guards.py).

Positions: ``ast`` counts columns in UTF-8 bytes; findings and fix edits count characters,
so every position goes through ``ScriptFacts``'s ``SourceText`` methods (check/lint/source.py).
"""

from __future__ import annotations

import ast
import gc
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ampaudit.check.lint.imports import ImportMap
from ampaudit.check.lint.nodes import arguments, dotted, unstarred, unwrap_cast
from ampaudit.check.lint.source import SourceText
from ampaudit.check.lint.values import string_value
from ampaudit.core.dtypes import BFLOAT16, FLOAT16, LowDtype

GRAD_SCALERS = frozenset({"torch.amp.GradScaler", "torch.cuda.amp.GradScaler", "torch.GradScaler",
                          "torch.amp.grad_scaler.GradScaler", "torch.cuda.amp.grad_scaler.GradScaler"})
AUTOCASTS = {  # qualified name -> the device it implies (None: given as an argument)
    "torch.autocast": None, "torch.amp.autocast": None, "torch.amp.autocast_mode.autocast": None,
    "torch.cuda.amp.autocast": "cuda", "torch.cpu.amp.autocast": "cpu",
}
T = TypeVar("T")
FLOAT16_NAMES = frozenset({"torch.float16", "torch.half"})
BFLOAT16_NAMES = frozenset({"torch.bfloat16"})


@dataclass(eq=False)
class Scope:
    kind: str  # "module" or "function"
    name: str


@dataclass(eq=False)
class Autocast:
    node: ast.With | ast.AsyncWith
    device: str | None  # "cuda", "cpu", or None when not a literal
    dtype: LowDtype | None  # None when not known statically
    scope: Scope
    line: int  # the `with` statement
    column: int
    enabled: bool = True  # False for autocast(enabled=False): a region where AMP is off
    dtype_text: str | None = None  # the dtype argument as written, when not a literal dtype


# A condition a statement runs under: the test expression and whether it held (True: the
# ``if`` body, or after an early exit from its ``else``; False: the ``else``, or after an
# early exit from the body).
Guard = tuple[ast.expr, bool]

# The simple statements written on one line (``a = f(); b = g()``): the first and the last.
# A fix inserts its new line above the first or below the last.
Line = tuple[ast.stmt, ast.stmt]


@dataclass(eq=False, slots=True)
class Call:
    node: ast.Call
    names: frozenset[str]  # qualified names of the callee ({} for methods on local objects)
    method: str | None  # attribute name for `x.method(...)`
    receiver: str | None  # dotted text of `x` in `x.method(...)`, when it is a plain name chain
    scope: Scope
    loop: ast.For | ast.AsyncFor | ast.While | None  # innermost loop around the call, in this scope
    autocast: Autocast | None  # innermost autocast block around the call, in this scope
    statement: Line | None  # the line of simple statements holding the call
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
        return enabled is not None and not (isinstance(enabled, ast.Constant) and type(enabled.value) is bool)

    @property
    def has_arguments(self) -> bool:
        """Anything between the parentheses: ``step(opt)``, ``step(optimizer=opt)``."""
        return bool(self.node.args or self.node.keywords)

    def kwarg(self, keyword: str) -> ast.expr | None:
        return next((k.value for k in self.node.keywords if k.arg == keyword), None)

    def arg(self, index: int, keyword: str | None = None) -> ast.expr | None:
        if keyword is not None and (value := self.kwarg(keyword)) is not None:
            return value
        positional = [a for a in self.node.args if a.__class__ is not ast.Starred]
        return positional[index] if index < len(positional) else None


@dataclass(eq=False)
class Assignment:
    target: str  # dotted text: "scaler", "self.scaler"
    call: Call


@dataclass(eq=False)
class ClassDef:
    node: ast.ClassDef
    bases: frozenset[str]  # qualified names of the bases
    decorated_methods: dict[str, frozenset[str]]  # method name -> qualified names of its decorators
    line: int
    column: int


@dataclass(eq=False)
class Import:
    node: ast.Import | ast.ImportFrom
    module: str  # "torch.cuda.amp" for `from torch.cuda.amp import x` and `import torch.cuda.amp`
    names: tuple[tuple[str, str], ...]  # (imported name, bound alias) for `from m import n as a`
    line: int
    column: int
    compat: bool = False  # in a fallback for old torch (see Call.compat)


@dataclass(eq=False)
class Reference:
    """An attribute such as ``torch.cuda.amp.autocast`` used as a value (not called):
    ``ac = torch.cuda.amp.autocast``, ``partial(torch.cuda.amp.GradScaler, ...)``."""

    node: ast.Attribute
    names: frozenset[str]
    line: int
    column: int
    compat: bool = False


@dataclass(eq=False)
class Decorator:
    node: ast.expr  # the expression after the ``@``
    names: frozenset[str]  # qualified names of the decorator (its callee, if called)
    line: int  # where the ``@`` is
    column: int


@dataclass(eq=False)
class Comparison:
    node: ast.Compare
    line: int
    column: int


@dataclass(eq=False)
class BinaryOp:
    node: ast.BinOp
    line: int
    column: int


@dataclass
class ScriptFacts(SourceText):
    """What the rules read of one file; positions and text through ``SourceText``."""

    path: str
    source: str
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
    module_scope: Scope = field(default_factory=lambda: Scope("module", "<module>"))  # the top level
    names: dict[ast.AST, frozenset[str]] = field(default_factory=dict, repr=False)
    imports_map: ImportMap = field(default_factory=lambda: ImportMap({}), repr=False)
    _references: dict[str, list[ast.AST]] = field(default_factory=dict, repr=False)
    _scalers: dict[int, frozenset[str]] = field(default_factory=dict, repr=False)  # per scope, once
    _by_scope: dict[Scope, list[Call]] | None = field(default=None, repr=False)  # calls_in
    _assigned: dict[frozenset[str], dict[Scope | None, list[Assignment]]] = field(default_factory=dict, repr=False)
    _once: dict[str, Any] = field(default_factory=dict, repr=False)
    amp_states: dict[Call, tuple[str | None, str | None]] = field(default_factory=dict, repr=False)  # guards.py

    def __post_init__(self) -> None:
        self.index()

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
        """Assignments of a call to one of ``names``, in ``scope`` or at module level (all of
        them without a scope)."""
        wanted = frozenset(names)
        if wanted not in self._assigned:  # asked per scope: the assignments are grouped once
            grouped: dict[Scope | None, list[Assignment]] = {None: []}
            for a in self.assignments:
                if a.call.names & wanted:
                    grouped[None].append(a)
                    grouped.setdefault(a.call.scope, []).append(a)
            self._assigned[wanted] = grouped
        grouped = self._assigned[wanted]
        if scope is None:
            return list(grouped[None])
        module = grouped.get(self.module_scope, [])
        if scope is self.module_scope:
            return list(module)
        return sorted([*module, *grouped.get(scope, ())], key=lambda a: (a.call.line, a.call.column))  # as written

    def once(self, key: str, compute: Callable[[], T]) -> T:
        """``compute()``, computed once per file: what several rules or every scope ask."""
        if key not in self._once:
            self._once[key] = compute()
        return self._once[key]

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

    def qualified(self, node: ast.AST) -> frozenset[str]:
        """Qualified names of any expression (``torch.float16``, an imported alias...)."""
        names = self.names.get(node)
        if names is None:
            names = self.names[node] = self.imports_map.qualify(node)
        return names

    def references(self, name: str) -> list[ast.AST]:
        """The nodes that read or rebind ``name``, a name an import of an old AMP module binds
        (those are tracked; the lint never sees a rebinding of them)."""
        return list(self._references.get(name, ()))


def relevant_statements(facts: ScriptFacts, tree: ast.Module, relevant: re.Pattern[str]) -> list[ast.stmt]:
    """The module's statements, less the top-level functions and classes whose text
    ``relevant`` (what the rules read) does not match: model code (layers, datasets,
    configs) holds nothing the protocol rules read, so it is not visited."""
    kept = []
    for node in tree.body:
        if node.__class__ in _DEFINITIONS:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if not relevant.search(facts.source, facts.line_start(first), facts.line_start(node.end_lineno + 1)):
                continue
        kept.append(node)
    return kept


def collect(path: str, source: str, relevant: re.Pattern[str] | None = None) -> ScriptFacts:
    """Parse ``source`` once and gather its facts; raises SyntaxError.

    ``relevant``: what the rules read (``RuleRegistry.read_pattern``); top-level functions
    and classes it does not match are not visited. None visits everything."""
    with _no_collection():
        tree = _parse(source)
        facts = ScriptFacts(path, source, imports_map=ImportMap.of(tree))
        body = relevant_statements(facts, tree, relevant) if relevant is not None else tree.body
        _Collector(facts).module(body)
    return facts


def _parse(source: str) -> ast.Module:
    """The syntax tree of ``source``, without the warnings Python's compiler gives about the
    code (``"\\."``, an invalid escape): the user asked for the lint's findings, not those."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(source)


@contextmanager
def _no_collection() -> Iterator[None]:
    """The cyclic garbage collector paused: a syntax tree and its facts hold no cycles, yet
    the millions of nodes of a large file set the collector off again and again (half the
    time of a parse, and more than linear in the file's size)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Collector:
    """The one walk over the tree, in source order (the order rules see calls in)."""

    def __init__(self, facts: ScriptFacts) -> None:
        self.facts = facts
        self.scope = facts.module_scope
        self.loops: list[ast.For | ast.AsyncFor | ast.While | None] = [None]
        self.autocasts: list[Autocast | None] = [None]
        self.statement: Line | None = None  # the line of simple statements being visited
        self.saved: list[tuple] = []  # enclosing scopes' state while inside a function
        self.backward_receivers: set[ast.AST] = set()  # calls whose result is .backward()-ed
        self.by_node: dict[ast.Call, Call] = {}
        self.guards: list[Guard] = []
        self.blocks: list[list[ast.stmt]] = []  # the indented blocks we are in (the module's first)
        self.block_exits: list[bool] = [False]
        self.exits: list[list[ast.stmt]] = []  # per early-exit guard: the block whose end drops it
        self.contexts: dict[str, ast.Call] = {}  # `ctx = torch.autocast(...)`: name -> the call
        self.scale_loss: list[bool] = [False]
        self.compat: list[bool] = [False]  # inside a try/except that falls back for old torch
        self.version_tests: dict[ast.AST, bool] = {}
        # names an import of an old AMP module binds: their reads are collected (references)
        self.tracked = {name for name, target in facts.imports_map.bound.items()
                        if target.startswith(("torch.cuda.amp", "torch.cpu.amp"))}
        self.handlers = _HANDLERS if self.tracked else _UNTRACKED_HANDLERS

    def module(self, body: list[ast.stmt]) -> None:
        self.blocks.append(body)
        self._statements(body)

    # -- the walk -------------------------------------------------------------------------
    def visit(self, node: ast.AST) -> None:
        handler = self.handlers.get(node.__class__)
        if handler is not None:
            handler(self, node)
            return
        children = _CHILDREN.get(node.__class__)
        if children is None:  # a node this table does not know (newer Python): field order
            for child in ast.iter_child_nodes(node):
                self.visit(child)
            return
        for name in children:
            child = getattr(node, name)
            if child.__class__ is list:
                for item in child:
                    if item is not None and item.__class__ is not ast.Constant:
                        self.visit(item)
            elif child is not None and child.__class__ is not ast.Constant:
                self.visit(child)

    def _visit_all(self, nodes: Iterable[ast.AST | None]) -> None:
        for node in nodes:
            if node is not None:
                self.visit(node)

    def _bind(self, name: str | None, node: ast.AST) -> None:
        """A tracked name rebound (a parameter, a function, ``except ... as``): like a read,
        it keeps the import's fix from renaming what it now means."""
        if name in self.tracked:
            self.facts._references.setdefault(name, []).append(node)

    # -- blocks and statements ----------------------------------------------------------
    def _block(self, body: list[ast.stmt], function: bool = False) -> None:
        if self.facts.on_header_line(body[0]):  # `if x: return`: no block of its own
            self._visit_all(body)
            return
        self.blocks.append(body)
        # A branch that returns (or a block inside one) is left before the code after it;
        # a function's own body returning is not an early exit.
        self.block_exits.append(not function and (self.block_exits[-1] or _exits(body)))
        self._statements(body)
        while self.exits and self.exits[-1] is body:
            self.guards.pop()
            self.exits.pop()
        self.blocks.pop()
        self.block_exits.pop()

    def _statements(self, body: list[ast.stmt]) -> None:
        index, count = 0, len(body)
        while index < count:
            node = body[index]
            if node.__class__ not in _SIMPLE:
                self.visit(node)
                index += 1
                continue
            last = index  # `a = f(); b = g()`: one line of statements
            while last + 1 < count and body[last + 1].__class__ in _SIMPLE \
                    and body[last + 1].lineno == body[last].end_lineno:
                last += 1
            self.statement = (node, body[last])
            for simple in body[index:last + 1]:
                self.visit(simple)
            self.statement = None
            index = last + 1

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.saved.append((self.scope, self.loops, self.autocasts, self.guards, self.scale_loss))
        # the decorators and defaults count as the function's own, as they always have
        self.scope = Scope("function", node.name)
        self.loops, self.autocasts, self.guards, self.scale_loss = [None], [None], [], [False]
        for decorator in node.decorator_list:
            self._decorator(decorator)
        self._bind(node.name, node)
        self.visit(node.args)
        if node.returns is not None:
            self.visit(node.returns)
        self._block(node.body, function=True)
        self.scope, self.loops, self.autocasts, self.guards, self.scale_loss = self.saved.pop()

    def _arguments(self, node: ast.arguments) -> None:
        positional = node.posonlyargs + node.args
        defaults = [None] * (len(positional) - len(node.defaults)) + node.defaults
        for arg, default in zip(positional, defaults, strict=True):
            self._arg(arg)
            if default is not None:
                self.visit(default)
        if node.vararg is not None:
            self._arg(node.vararg)
        for arg, default in zip(node.kwonlyargs, node.kw_defaults, strict=True):
            self._arg(arg)
            if default is not None:
                self.visit(default)
        if node.kwarg is not None:
            self._arg(node.kwarg)

    def _arg(self, node: ast.arg) -> None:
        self._bind(node.arg, node)
        if node.annotation is not None:
            self.visit(node.annotation)

    def _class(self, node: ast.ClassDef) -> None:
        bases = frozenset(n for base in node.bases for n in self.facts.qualified(unstarred(base)))
        methods = {}
        for stmt in node.body:
            if stmt.__class__ in _FUNCTIONS:
                methods[stmt.name] = frozenset(n for d in stmt.decorator_list for n in self.facts.qualified(_callee(d)))
        if "backward" in methods and not bases & _AUTOGRAD_FUNCTIONS:
            self.facts.local_backward_classes.add(node.name)  # its backward is not torch's
        line, column = self.facts.position(node)
        self.facts.classes.append(ClassDef(node, bases, methods, line, column))
        for decorator in node.decorator_list:
            self._decorator(decorator)
        self._bind(node.name, node)
        self._visit_all(node.bases)
        self._visit_all(node.keywords)
        self._block(node.body)

    def _decorator(self, node: ast.expr) -> None:
        line, column = self.facts.decorator_position(node)  # at the `@`, as the finding has always been
        self.facts.decorators.append(Decorator(node, self.facts.qualified(_callee(node)), line, column))
        self.visit(node)

    # -- paths: the conditions a statement runs under ------------------------------------
    def _if(self, node: ast.If) -> None:
        self.visit(node.test)
        self.guards.append((node.test, True))
        self._block(node.body)
        self.guards.pop()
        orelse = node.orelse
        if orelse:
            self.guards.append((node.test, False))
            if self._is_elif(orelse):
                self._if(orelse[0])  # an `elif` has no block of its own
            else:
                self._block(orelse)
            self.guards.pop()  # the last guard: after an `elif` that exits early, that one
        # `if not use_amp: loss.backward(); continue` - the rest of the block runs only
        # when the test was false (and vice versa for an else that exits).
        body_exits = _exits(node.body)
        else_exits = bool(orelse) and _exits(orelse)
        if body_exits != else_exits:
            self.guards.append((node.test, not body_exits))
            self.exits.append(self.blocks[-1])

    def _is_elif(self, orelse: list[ast.stmt]) -> bool:
        first = orelse[0]
        return len(orelse) == 1 and first.__class__ is ast.If and self.facts.source.startswith(
            "elif", self.facts.offset(first.lineno, first.col_offset))

    def _if_expression(self, node: ast.IfExp) -> None:
        # `a if test else b`: the same guards as an if statement, in the order it is written
        self.guards.append((node.test, True))
        self.visit(node.body)
        self.guards.pop()
        self.visit(node.test)
        self.guards.append((node.test, False))
        self.visit(node.orelse)
        self.guards.pop()

    # -- fallbacks for old torch: try/except ImportError, version checks --------------------
    def _try(self, node: ast.Try) -> None:
        catches = any(_catches_compat(h) for h in node.handlers)
        self.compat.append(self.compat[-1] or catches)
        self._block(node.body)
        self.compat.pop()
        for handler in node.handlers:
            self.compat.append(self.compat[-1] or _catches_compat(handler))
            self._handler(handler)
            self.compat.pop()
        self._else_blocks(node)

    def _try_star(self, node: ast.TryStar) -> None:  # except*: never a fallback for old torch
        self._block(node.body)
        for handler in node.handlers:
            self._handler(handler)
        self._else_blocks(node)

    def _handler(self, node: ast.ExceptHandler) -> None:
        if node.type is not None:
            self.visit(node.type)
        self._bind(node.name, node)
        self._block(node.body)

    def _else_blocks(self, node: ast.Try | ast.TryStar) -> None:
        if node.orelse:
            self._block(node.orelse)
        if node.finalbody:
            self._block(node.finalbody)

    def _in_compat(self) -> bool:
        if self.compat[-1]:
            return True
        for test, _ in self.guards:
            if test not in self.version_tests:
                self.version_tests[test] = bool(_VERSION_TEST.search(self.facts.text(test)))
            if self.version_tests[test]:
                return True
        return False

    # -- loops and with -------------------------------------------------------------------
    def _for(self, node: ast.For | ast.AsyncFor) -> None:
        self.loops.append(node)
        self.visit(node.target)
        self.visit(node.iter)
        self._loop_blocks(node)

    def _while(self, node: ast.While) -> None:
        self.loops.append(node)
        self.visit(node.test)
        self._loop_blocks(node)

    def _loop_blocks(self, node: ast.For | ast.AsyncFor | ast.While) -> None:
        self._block(node.body)
        if node.orelse:
            self._block(node.orelse)
        self.loops.pop()

    def _with(self, node: ast.With | ast.AsyncWith) -> None:
        block = None
        scale_loss = self.scale_loss[-1]
        for item in node.items:
            call = item.context_expr
            if call.__class__ is not ast.Call or self._autocast_device(call.func) is False:
                bound = dotted(call.func if call.__class__ is ast.Call else call)  # `with ctx:` / `with ctx():`
                call = self.contexts.get(bound or "")
            if call.__class__ is ast.Call and (device := self._autocast_device(call.func)) is not False:
                block = self._autocast(node, call, device)
            elif _calls_method(item.context_expr, "scale_loss"):
                scale_loss = True  # apex: backward inside runs on the scaled loss
        self.autocasts.append(block or self.autocasts[-1])
        self.scale_loss.append(scale_loss)
        for item in node.items:
            self.visit(item.context_expr)
            if item.optional_vars is not None:
                self.visit(item.optional_vars)
        self._block(node.body)
        self.autocasts.pop()
        self.scale_loss.pop()

    def _autocast(self, node: ast.With | ast.AsyncWith, call: ast.Call, device: str | None) -> Autocast:
        written = arguments(call)
        args = [a for a in written if a.keyword is None]
        keywords = {a.keyword: a.value for a in written if a.keyword is not None}
        if device is None:
            value = keywords.get("device_type", args[0].value if args else None)
            device = string_value(value)
        dtype_node = keywords.get("dtype", args[1].value if device is not None and len(args) > 1 else None)
        dtype = dtype_text = None
        if dtype_node is not None:
            names = self.facts.qualified(dtype_node)
            dtype = FLOAT16 if names & FLOAT16_NAMES else BFLOAT16 if names & BFLOAT16_NAMES else None
            dtype_text = None if dtype else self.facts.code(dtype_node)
        elif device == "cuda":
            dtype = FLOAT16  # CUDA autocast's default
        elif device == "cpu":
            dtype = BFLOAT16
        line, column = self.facts.position(node)
        block = Autocast(node, device, dtype, self.scope, line, column,
                         enabled=not _is_false(keywords.get("enabled")), dtype_text=dtype_text)
        self.facts.autocasts.append(block)
        return block

    def _autocast_in(self, value: ast.expr) -> ast.Call | None:
        """The autocast call a context variable holds: ``torch.autocast(...)``, one side of
        ``nullcontext() if cpu else torch.autocast(...)``, ``partial(torch.autocast, ...)``, or
        the uncalled function (``accelerator.autocast if amp else nullcontext``)."""
        for candidate in (value, *(getattr(value, side, None) for side in ("body", "orelse"))):
            if candidate.__class__ in _NAMES and self._autocast_device(candidate) is not False:
                return ast.Call(func=candidate, args=[], keywords=[])  # `ctx = accelerator.autocast if amp else ...`
            if candidate.__class__ is not ast.Call:
                continue
            if self._autocast_device(candidate.func) is not False:
                return candidate
            written = arguments(candidate)
            if "functools.partial" in self.facts.qualified(candidate.func) and written \
                    and self._autocast_device(written[0].value) is not False:
                rest = [a.node for a in written[1:]]
                return ast.Call(func=written[0].value, args=[a for a in rest if a.__class__ is not ast.keyword],
                                keywords=[a for a in rest if a.__class__ is ast.keyword])
        return None

    def _autocast_device(self, func: ast.expr) -> str | bool | None:
        """The device an autocast callee implies (None: an argument, or a framework's own
        ``x.autocast``); False when ``func`` is no autocast."""
        for name in self.facts.qualified(func):
            if name in AUTOCASTS:
                return AUTOCASTS[name]
        if func.__class__ is ast.Attribute and func.attr == "autocast":
            return None  # accelerator.autocast(), a trainer's own: AMP of some dtype
        return False

    # -- events ---------------------------------------------------------------------------
    def _call(self, node: ast.Call) -> None:
        func = node.func
        method = receiver = None
        if func.__class__ is ast.Attribute:
            method = func.attr
            receiver = dotted(func.value)
            # x.scale(loss).backward(): the outer call is visited first; mark the inner one, so
            # that scalers are also found by use.
            if method == "backward" and func.value.__class__ is ast.Call:
                self.backward_receivers.add(unwrap_cast(func.value))
        line, column = self.facts.position(node)
        call = Call(node, self.facts.qualified(func), method, receiver, self.scope, self.loops[-1],
                    self.autocasts[-1], self.statement, line, column,
                    feeds_backward=node in self.backward_receivers, guards=tuple(self.guards),
                    in_scale_loss=self.scale_loss[-1], block_exits=self.block_exits[-1], compat=self._in_compat())
        enabled = call.kwarg("enabled")
        if enabled is not None and call.names & _AMP_SWITCHES:
            self.facts.enabled_flags.update(_flag_names(enabled))
        self.facts.calls.append(call)
        self.by_node[node] = call
        self.visit(func)
        if node.keywords:
            self._visit_all(a.node for a in arguments(node))
        else:
            self._visit_all(node.args)

    def _assign(self, node: ast.Assign) -> None:
        self._visit_all(node.targets)
        self.visit(node.value)
        value = node.value
        block = self.autocasts[-1]
        # a value computed under enabled autocast, or cast with .half(), is low precision
        low = (block is not None and block.enabled) or _calls_method(value, "half")
        scaled = unwrap_cast(value)
        scaler = dotted(scaled.func.value) if _calls_method(scaled, "scale") else None
        for target in node.targets:
            for element in _targets(target):
                bound = dotted(element)
                if bound and low:
                    self.facts.low_names.setdefault((id(self.scope), bound), node.lineno)
                elif bound:
                    self.facts.low_names.pop((id(self.scope), bound), None)  # reassigned in fp32
            name = dotted(target)
            if not name:
                continue
            if scaler:
                self.facts.scaled_values[(id(self.scope), name)] = scaler
            else:
                self.facts.scaled_values.pop((id(self.scope), name), None)
            context = self._autocast_in(value)
            if context is not None:
                self.contexts[name] = context
            call = value if value.__class__ is ast.Call else _conditional_call(value)
            if call is not None and call in self.by_node:
                self.facts.assignments.append(Assignment(name, self.by_node[call]))
                callee = dotted(call.func)
                if callee in self.facts.local_backward_classes:
                    self.facts.instances[name] = callee

    def _compare(self, node: ast.Compare) -> None:
        # `scaler.get_scale() != before`: kept for the skip-check rule; the sides are read there
        if len(node.ops) == 1 and node.ops[0].__class__ in (ast.NotEq, ast.Eq) \
                and (_calls_method(node.left, "get_scale") or _calls_method(node.comparators[0], "get_scale")):
            line, column = self.facts.position(node)
            self.facts.scale_comparisons.append(Comparison(node, line, column))
        self.visit(node.left)
        self._visit_all(node.comparators)

    def _binary(self, node: ast.BinOp) -> None:
        if node.op.__class__ in (ast.Add, ast.Sub):
            line, column = self.facts.position(node)
            self.facts.binary_ops.append(BinaryOp(node, line, column))
        self.visit(node.left)
        self.visit(node.right)

    def _attribute(self, node: ast.Attribute) -> None:
        if node.attr in _AMP_ATTRIBUTES:
            line, column = self.facts.position(node)
            self.facts.amp_references.append(Reference(node, self.facts.qualified(node), line, column,
                                                       self._in_compat()))
        self.visit(node.value)

    def _name(self, node: ast.Name) -> None:
        if node.id in self.tracked:
            self.facts._references.setdefault(node.id, []).append(node)

    def _dict(self, node: ast.Dict) -> None:
        for key, value in zip(node.keys, node.values, strict=True):  # in the order written
            if key is not None:
                self.visit(key)
            self.visit(value)

    def _import_from(self, node: ast.ImportFrom) -> None:
        if node.module is not None:
            self._bind(node.module.split(".")[0], node)  # `from amp import x` names `amp` too
        if node.module is None or node.names[0].name == "*":
            return
        line, column = self.facts.position(node)
        module = "." * node.level + node.module
        names = tuple((a.name, a.asname or a.name) for a in node.names)
        self.facts.imports.append(Import(node, module, names, line, column, self._in_compat()))

    def _import(self, node: ast.Import) -> None:
        line, column = self.facts.position(node)
        for alias in node.names:
            bound = alias.asname or alias.name.split(".")[0]
            self.facts.imports.append(Import(node, alias.name, ((alias.name, bound),), line, column,
                                             self._in_compat()))

    def _global(self, node: ast.Global | ast.Nonlocal) -> None:
        for name in node.names:
            self._bind(name, node)

    def _match(self, node: ast.Match) -> None:
        self.visit(node.subject)
        for case in node.cases:
            self.visit(case.pattern)
            if case.guard is not None:
                self.visit(case.guard)
            self._block(case.body)


_Handler = Callable[[_Collector, ast.AST], None]
_HANDLERS: dict[type, _Handler] = {
    ast.Call: _Collector._call, ast.Assign: _Collector._assign, ast.Compare: _Collector._compare,
    ast.BinOp: _Collector._binary, ast.Attribute: _Collector._attribute, ast.Name: _Collector._name,
    ast.IfExp: _Collector._if_expression, ast.Dict: _Collector._dict,
    ast.FunctionDef: _Collector._function, ast.AsyncFunctionDef: _Collector._function,
    ast.arguments: _Collector._arguments, ast.ClassDef: _Collector._class,
    ast.If: _Collector._if, ast.For: _Collector._for, ast.AsyncFor: _Collector._for, ast.While: _Collector._while,
    ast.With: _Collector._with, ast.AsyncWith: _Collector._with, ast.Try: _Collector._try,
    ast.Import: _Collector._import, ast.ImportFrom: _Collector._import_from,
    ast.Global: _Collector._global, ast.Nonlocal: _Collector._global, ast.Match: _Collector._match,
}
if hasattr(ast, "TryStar"):  # Python 3.11+
    _HANDLERS[ast.TryStar] = _Collector._try_star
# A file that imports nothing from the old AMP modules tracks no name: names are leaves
_UNTRACKED_HANDLERS = {kind: handler for kind, handler in _HANDLERS.items() if kind is not ast.Name}

# The child fields of every other node, in the order they are written (the order calls are
# collected in). Constants and names without handlers have none.
_CHILDREN: dict[type, tuple[str, ...]] = {
    ast.Expr: ("value",), ast.Return: ("value",), ast.Delete: ("targets",),
    ast.AugAssign: ("target", "value"), ast.AnnAssign: ("target", "annotation", "value"),
    ast.Raise: ("exc", "cause"), ast.Assert: ("test", "msg"), ast.Pass: (), ast.Break: (), ast.Continue: (),
    ast.BoolOp: ("values",), ast.NamedExpr: ("target", "value"), ast.UnaryOp: ("operand",),
    ast.Lambda: ("args", "body"), ast.Set: ("elts",), ast.ListComp: ("elt", "generators"),
    ast.SetComp: ("elt", "generators"), ast.GeneratorExp: ("elt", "generators"),
    ast.DictComp: ("key", "value", "generators"), ast.comprehension: ("target", "iter", "ifs"),
    ast.Await: ("value",), ast.Yield: ("value",), ast.YieldFrom: ("value",),
    ast.FormattedValue: ("value", "format_spec"), ast.JoinedStr: ("values",), ast.Constant: (), ast.Name: (),
    ast.Subscript: ("value", "slice"), ast.Starred: ("value",), ast.List: ("elts",), ast.Tuple: ("elts",),
    ast.Slice: ("lower", "upper", "step"), ast.keyword: ("value",),
    ast.MatchValue: ("value",), ast.MatchSingleton: (), ast.MatchSequence: ("patterns",),
    ast.MatchMapping: ("keys", "patterns"), ast.MatchClass: ("cls", "patterns", "kwd_patterns"),
    ast.MatchStar: (), ast.MatchAs: ("pattern",), ast.MatchOr: ("patterns",),
}

_SIMPLE = frozenset({ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Delete, ast.Pass,
                     ast.Break, ast.Continue, ast.Raise, ast.Global, ast.Nonlocal, ast.Import, ast.ImportFrom,
                     ast.Assert, *((ast.TypeAlias,) if hasattr(ast, "TypeAlias") else ())})
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_DEFINITIONS = frozenset({*_FUNCTIONS, ast.ClassDef})
_NAMES = (ast.Name, ast.Attribute)
_AMP_SWITCHES = GRAD_SCALERS | frozenset(AUTOCASTS)
_SCALER_NAME = re.compile(r"(^|[._])(grad_|amp_|loss_|amp_grad_|d_|g_)?scaler(_\w+)?$", re.IGNORECASE)
_AUTOGRAD_FUNCTIONS = frozenset({"torch.autograd.Function", "torch.autograd.function.Function"})
_EXITS = (ast.Return, ast.Continue, ast.Break, ast.Raise)
_COMPAT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError", "AttributeError"})
# `if version.parse(torch.__version__) < ...`, `TORCH_2_4`, `is_torch_greater_or_equal(...)`,
# `hasattr(torch.amp, "GradScaler")`: code chosen by the installed torch's version.
_VERSION_TEST = re.compile(r"version|TORCH_\d|hasattr\(\s*torch", re.IGNORECASE)
_AMP_ATTRIBUTES = frozenset({"autocast", "GradScaler", "custom_fwd", "custom_bwd"})


def _is_false(value: ast.expr | None) -> bool:
    return value.__class__ is ast.Constant and value.value is False


def _calls_method(node: ast.AST, method: str) -> bool:
    """``x.method(...)``."""
    return node.__class__ is ast.Call and node.func.__class__ is ast.Attribute and node.func.attr == method


def _callee(node: ast.expr) -> ast.expr:
    """What a decorator names: ``custom_fwd`` in ``@custom_fwd(...)`` and ``@custom_fwd``."""
    return node.func if node.__class__ is ast.Call else node


def _catches_compat(handler: ast.ExceptHandler) -> bool:
    """``except ImportError`` / ``except (ImportError, AttributeError)``: a fallback for an
    API an older (or newer) torch lacks."""
    kind = handler.type
    if kind is None:
        return False
    names = kind.elts if kind.__class__ is ast.Tuple else [kind]
    return any((dotted(n) or "").rsplit(".", 1)[-1] in _COMPAT_ERRORS for n in names)


def _exits(block: list[ast.stmt]) -> bool:
    """Whether a block always leaves its enclosing block: it ends in return/continue/break/raise."""
    return isinstance(block[-1], _EXITS)


def _flag_names(expr: ast.expr) -> set[str]:
    """The names an ``enabled=`` expression reads: ``use_amp``, ``args.amp``, and each side of
    ``dtype == "float16"`` or ``not x``."""
    name = dotted(expr)
    if name:
        return {name}
    found: set[str] = set()
    if expr.__class__ is ast.Attribute:  # `f().amp`: what the call is made of, and `amp`
        return _flag_names(expr.value) | {expr.attr}
    for child in _FLAG_PARTS.get(expr.__class__, ()):
        value = getattr(expr, child)
        for part in value if value.__class__ is list else (value,):
            if part is not None:
                found |= _flag_names(part)
    return found


# the parts of an expression that are themselves expressions (not arguments, elements, keys)
_FLAG_PARTS = {
    ast.BoolOp: ("values",), ast.UnaryOp: ("operand",), ast.Compare: ("left", "comparators"),
    ast.BinOp: ("left", "right"), ast.IfExp: ("body", "test", "orelse"), ast.Call: ("func",),
    ast.Subscript: ("value",), ast.Lambda: ("body",), ast.NamedExpr: ("target", "value"),
    ast.Await: ("value",), ast.Yield: ("value",), ast.ListComp: ("elt",),
    ast.SetComp: ("elt",), ast.GeneratorExp: ("elt",), ast.DictComp: ("key", "value"),
}


def _targets(target: ast.expr) -> list[ast.expr]:
    """The names an assignment binds: ``a``, ``self.a``, each of ``a, b = ...``."""
    if target.__class__ in (ast.Tuple, ast.List):
        return [t for e in target.elts for t in _targets(unstarred(e))]
    return [target]


def _conditional_call(value: ast.expr) -> ast.Call | None:
    """The call in ``Call(...) if cond else None`` (either side), which still builds the value."""
    if value.__class__ is ast.IfExp:
        for side in (value.body, value.orelse):
            if side.__class__ is ast.Call:
                return side
    return None
