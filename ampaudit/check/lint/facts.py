"""What the lint rules read of a training script: the facts one visit collects (visit.py),
read-only once it ends.

Each call is recorded with its qualified name, receiver, enclosing function, loop, autocast
block, statement and the conditions it runs under; each assignment of a call result, each
autocast block and the few other shapes rules look at. Rules are plain functions over these
facts - the file is parsed and walked once, whatever the number of rules (collect.py).

Scopes: each function body (nested functions separately) and the module's top level. Rules
compare events of one scope only, so two unrelated functions never combine into a finding;
``ScriptFacts`` answers per scope from an index built when the visit ends (scopes.py).

Read-only: every record is immutable (a frozen dataclass; a call, a named tuple) and every
collection a tuple, a frozenset or a read-only mapping, so a rule cannot change what the next
rule reads. What a helper derives from the facts and several rules ask is memoized outside
them (memo.py).

Positions: ``ast`` counts columns in UTF-8 bytes; findings and fix edits count characters,
so every position goes through ``ScriptFacts``'s ``SourceText`` methods (source.py).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import InitVar, dataclass, field
from typing import NamedTuple

from ampaudit.check.lint.imports import ImportMap
from ampaudit.check.lint.source import SourceText
from ampaudit.check.lint.values import is_false
from ampaudit.core.dtypes import LowDtype

GRAD_SCALERS = frozenset({"torch.amp.GradScaler", "torch.cuda.amp.GradScaler", "torch.GradScaler",
                          "torch.amp.grad_scaler.GradScaler", "torch.cuda.amp.grad_scaler.GradScaler",
                          "torch.cpu.amp.GradScaler", "torch.cpu.amp.grad_scaler.GradScaler"})
FLOAT16_NAMES = frozenset({"torch.float16", "torch.half"})
BFLOAT16_NAMES = frozenset({"torch.bfloat16"})


@dataclass(frozen=True, eq=False)
class Scope:
    kind: str  # "module" or "function"
    name: str


@dataclass(frozen=True, eq=False)
class Autocast:
    node: ast.With | ast.AsyncWith
    device: str | None  # "cuda", "cpu", or None when not a literal
    dtype: LowDtype | None  # None when not known statically
    scope: Scope
    line: int  # the `with` statement
    column: int
    enabled: bool = True  # False for autocast(enabled=False): a region where AMP is off
    dtype_text: str | None = None  # the dtype argument as written, when not a literal dtype
    switched: bool = False  # enabled=<expression>: on in some runs only


# A condition a statement runs under: the test expression and whether it held (True: the
# ``if`` body, or after an early exit from its ``else``; False: the ``else``, or after an
# early exit from the body).
Guard = tuple[ast.expr, bool]

# The simple statements written on one line (``a = f(); b = g()``): the first and the last.
# A fix inserts its new line above the first or below the last.
Line = tuple[ast.stmt, ast.stmt]


class Call(NamedTuple):
    # A NamedTuple rather than a frozen dataclass: one is made per call in the file, and a
    # frozen dataclass takes several times as long to build. Equal and hashed by identity,
    # like the other records.
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

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    @property
    def disabled(self) -> bool:
        """``enabled=False`` written out: a GradScaler or autocast that does nothing."""
        return is_false(self.kwarg("enabled"))

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


@dataclass(frozen=True, eq=False)
class Assignment:
    target: str  # dotted text: "scaler", "self.scaler"
    call: Call


@dataclass(frozen=True, eq=False)
class ClassDef:
    node: ast.ClassDef
    bases: frozenset[str]  # qualified names of the bases
    decorated_methods: Mapping[str, frozenset[str]]  # method name -> qualified names of its decorators
    line: int
    column: int


@dataclass(frozen=True, eq=False)
class Import:
    node: ast.Import | ast.ImportFrom
    module: str  # "torch.cuda.amp" for `from torch.cuda.amp import x` and `import torch.cuda.amp`
    # (imported name, bound alias) for `from m import n as a`; for `from m import *`, each name
    # it binds as (name, name) - none where the lint does not know m's (imports.STAR_EXPORTS)
    names: tuple[tuple[str, str], ...]
    line: int
    column: int
    compat: bool = False  # in a fallback for old torch (see Call.compat)


@dataclass(frozen=True, eq=False)
class Reference:
    """An attribute such as ``torch.cuda.amp.autocast`` used as a value (not called):
    ``ac = torch.cuda.amp.autocast``, ``partial(torch.cuda.amp.GradScaler, ...)``."""

    node: ast.Attribute
    names: frozenset[str]
    line: int
    column: int
    compat: bool = False
    annotation: bool = False  # in a type annotation (`scaler: torch.cuda.amp.GradScaler`)


@dataclass(frozen=True, eq=False)
class Decorator:
    node: ast.expr  # the expression after the ``@``
    names: frozenset[str]  # qualified names of the decorator (its callee, if called)
    line: int  # where the ``@`` is
    column: int


@dataclass(frozen=True, eq=False)
class Comparison:
    node: ast.Compare
    line: int
    column: int


@dataclass(frozen=True, eq=False)
class BinaryOp:
    node: ast.BinOp
    line: int
    column: int


@dataclass(frozen=True, eq=False)
class ScriptFacts(SourceText):
    """What the rules read of one file; positions and text through ``SourceText``.

    Built once by the visit, read-only afterwards: assigning a field raises, and the fields
    are tuples, frozensets and read-only mappings."""

    path: str
    calls: tuple[Call, ...]  # in source order
    assignments: tuple[Assignment, ...]
    autocasts: tuple[Autocast, ...]
    classes: tuple[ClassDef, ...]
    imports: tuple[Import, ...]
    decorators: tuple[Decorator, ...]
    binary_ops: tuple[BinaryOp, ...]
    amp_references: tuple[Reference, ...]
    scale_comparisons: tuple[Comparison, ...]  # == / != with a get_scale() side
    # (scope id, name) -> (dtype, line): what the name holds after its last assignment -
    # "low" (fp16/bf16; the line of the first low assignment) or "fp32" - by inference.py;
    # a name of unknown dtype is absent
    name_dtypes: Mapping[tuple[int, str], tuple[str, int]]
    scaled_values: Mapping[tuple[int, str], str]  # `loss = scaler.scale(loss)`: -> scaler
    enabled_flags: frozenset[str]  # dotted names passed as enabled= to AMP APIs
    local_backward_classes: frozenset[str]  # classes defined here with a backward()
    instances: Mapping[str, str]  # name -> local class it was built from
    returns: Mapping[Scope, frozenset[str]]  # function scope -> the dotted names its `return`s give
    methods: Mapping[Scope, str]  # a function defined in a class body -> the class's name
    mentions_float16: bool  # torch.float16 / torch.half appears in the visited code
    module_scope: Scope  # the top level
    imports_map: ImportMap = field(repr=False)
    name_references: Mapping[str, tuple[ast.AST, ...]] = field(repr=False)  # see references()
    annotation_references: frozenset[int] = field(repr=False)  # ids of those read in a type annotation
    # the per-scope index (scopes.py): every scope the visit entered is a key of scalers_by_scope
    calls_by_scope: Mapping[Scope, tuple[Call, ...]] = field(repr=False)  # scopes holding calls, first call first
    assignments_by_scope: Mapping[Scope, tuple[Assignment, ...]] = field(repr=False)
    scalers_by_scope: Mapping[Scope, frozenset[str]] = field(repr=False)
    positions: InitVar[SourceText | None] = None  # the visit's SourceText of the same text: its index is reused

    def __post_init__(self, positions: SourceText | None) -> None:
        if positions is None:
            super().__post_init__()
        else:
            self._set_index(positions._starts, positions._ascii, positions.newline)

    def calls_to(self, names: Iterable[str]) -> Iterator[Call]:
        wanted = frozenset(names)
        return (c for c in self.calls if c.names & wanted)

    def method_calls(self, method: str, scope: Scope | None = None) -> Iterator[Call]:
        return (c for c in (self.calls if scope is None else self.calls_in(scope)) if c.method == method)

    def calls_in(self, scope: Scope) -> tuple[Call, ...]:
        """The calls of one function (or the module's top level), in order."""
        return self.calls_by_scope.get(scope, ())

    def scopes(self) -> tuple[Scope, ...]:
        """The scopes that hold calls, in the order their first call appears."""
        return tuple(self.calls_by_scope)

    def assigned(self, names: Iterable[str], scope: Scope | None = None) -> list[Assignment]:
        """Assignments of a call to one of ``names``, in ``scope`` or at module level (all of
        them without a scope)."""
        wanted = frozenset(names)
        if scope is None:
            return [a for a in self.assignments if a.call.names & wanted]
        module = [a for a in self.assignments_by_scope.get(self.module_scope, ()) if a.call.names & wanted]
        if scope is self.module_scope:
            return module
        own = [a for a in self.assignments_by_scope.get(scope, ()) if a.call.names & wanted]
        return sorted([*module, *own], key=lambda a: (a.call.line, a.call.column))  # as written

    def scalers(self, scope: Scope) -> frozenset[str]:
        """Names holding a GradScaler in ``scope``: assigned one here or at module level, or
        used as one (``x.scale(loss).backward()``). ``GradScaler(enabled=False)`` is not one."""
        return self.scalers_by_scope[scope]

    def qualified(self, node: ast.AST) -> frozenset[str]:
        """Qualified names of any expression (``torch.float16``, an imported alias...)."""
        return self.imports_map.qualify(node)

    def references(self, name: str) -> tuple[ast.AST, ...]:
        """The nodes that read or rebind ``name``, a name an import of an old AMP module binds
        (those are tracked; the lint never sees a rebinding of them)."""
        return self.name_references.get(name, ())
