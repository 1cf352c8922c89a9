"""The one walk over a script's syntax tree that collects its facts (facts.py), in source
order - the order rules see calls in.

Along the way it keeps what each event needs: the scope (a function body, or the module's
top level), the innermost loop and autocast block, the line of simple statements, and the
conditions a statement runs under (``guards``: the ``if`` / ``else`` branches and conditional
expressions around it, and the early ``return`` / ``continue`` before it). Which of them
switch AMP on or off is decided later, when every scaler and ``enabled=`` flag of the file
is known (guards.py). It also marks code in a fallback for old torch (``try``/``except
ImportError``, a branch on the torch version or on a name assigned from it: versions.py).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from types import MappingProxyType

from ampaudit.check.lint import autocasts, inference, scopes, versions
from ampaudit.check.lint.facts import (
    FLOAT16_NAMES,
    GRAD_SCALERS,
    Assignment,
    Autocast,
    BinaryOp,
    Call,
    ClassDef,
    Comparison,
    Decorator,
    Guard,
    Import,
    Line,
    Reference,
    Scope,
    ScriptFacts,
)
from ampaudit.check.lint.imports import ImportMap, catches_compat, star_names
from ampaudit.check.lint.nodes import arguments, dotted, unstarred, unwrap_cast
from ampaudit.check.lint.source import SourceText


@dataclass(eq=False)
class _Found:
    """What the walk has collected so far (``Visitor.facts`` freezes it into ``ScriptFacts``)."""

    calls: list[Call] = field(default_factory=list)
    assignments: list[Assignment] = field(default_factory=list)
    autocasts: list[Autocast] = field(default_factory=list)
    classes: list[ClassDef] = field(default_factory=list)
    imports: list[Import] = field(default_factory=list)
    decorators: list[Decorator] = field(default_factory=list)
    binary_ops: list[BinaryOp] = field(default_factory=list)
    amp_references: list[Reference] = field(default_factory=list)
    annotation_references: set[int] = field(default_factory=set)  # ids of tracked names read in annotations
    scale_comparisons: list[Comparison] = field(default_factory=list)
    name_dtypes: dict[tuple[int, str], tuple[str, int]] = field(default_factory=dict)
    scaled_values: dict[tuple[int, str], str] = field(default_factory=dict)
    enabled_flags: set[str] = field(default_factory=set)
    local_backward_classes: set[str] = field(default_factory=set)
    instances: dict[str, str] = field(default_factory=dict)
    returns: dict[Scope, set[str]] = field(default_factory=dict)
    methods: dict[Scope, str] = field(default_factory=dict)
    references: dict[str, list[ast.AST]] = field(default_factory=dict)
    functions: list[Scope] = field(default_factory=list)  # every function scope entered
    mentions_float16: bool = False


class Visitor:
    """The one walk over the tree, in source order (the order rules see calls in)."""

    def __init__(self, text: SourceText, imports: ImportMap, functions: frozenset[str] = frozenset(),
                 infer_dtypes: bool = True) -> None:
        self.text = text
        self.imports = imports
        self.found = _Found()
        self.module_scope = self.scope = Scope("module", "<module>")
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
        # `ctx = torch.autocast(...)`: (the function a plain name is local to, or None for a
        # module-level name or an attribute such as self.ctx, name) -> the call
        self.contexts: dict[tuple[int | None, str], ast.Call] = {}
        self.scale_loss: list[bool] = [False]
        self.compat: list[bool] = [False]  # inside a try/except that falls back for old torch
        self.annotating = False  # inside a type annotation: names there are typing, not calls
        self.version_tests: dict[ast.AST, bool] = {}
        # `_NEW_AMP = Version(torch.__version__) >= Version("2.4")`: (the function a plain name
        # is local to, or None, name), as for contexts - looked for only in a file that tests
        # the torch version somewhere
        self.version_flags: set[tuple[int | None, str]] = set()
        self.tests_version = versions.TORCH_VALUE.search(text.source) is not None
        self.class_body: str | None = None  # the class whose body is being visited (not its methods')
        self.nn_modules: dict[str, str] = {}  # `criterion = nn.MSELoss()`: name -> torch.nn class
        # a callee that is a function (imported, or defined at the top level), not a model
        self.functions = functions
        self.infer_dtypes = infer_dtypes
        self.inference = inference.Inference(self._dtype_of, self.qualified, self.nn_modules.get, self._is_function)
        # names an import of an old AMP module binds: their reads are collected (references)
        self.tracked = {name for name, target in imports.bound.items()
                        if target.startswith(("torch.cuda.amp", "torch.cpu.amp"))}
        # names bound to torch.float16 itself (`from torch import float16`): a read mentions it
        self.float16_names = {name for name, target in imports.bound.items() if target in FLOAT16_NAMES}
        self.handlers = _HANDLERS if self.tracked or self.float16_names else _WITHOUT_NAMES
        # the walk asks a callee's names several times (the call, an assignment of it, a
        # `with`): each expression is qualified once
        self.names: dict[ast.AST, frozenset[str]] = {}

    def module(self, body: list[ast.stmt]) -> None:
        self.blocks.append(body)
        self._statements(body)

    def facts(self, path: str) -> ScriptFacts:
        """What the walk collected, frozen: the rules' read-only view of the file."""
        found = self.found
        calls, assignments = tuple(found.calls), tuple(found.assignments)
        calls_by_scope = scopes.grouped(calls, _SCOPE_OF_CALL)
        assignments_by_scope = scopes.grouped(assignments, _SCOPE_OF_ASSIGNMENT)
        return ScriptFacts(
            source=self.text.source, path=path, calls=calls, assignments=assignments,
            autocasts=tuple(found.autocasts), classes=tuple(found.classes), imports=tuple(found.imports),
            decorators=tuple(found.decorators), binary_ops=tuple(found.binary_ops),
            amp_references=tuple(found.amp_references), scale_comparisons=tuple(found.scale_comparisons),
            name_dtypes=MappingProxyType(found.name_dtypes), scaled_values=MappingProxyType(found.scaled_values),
            enabled_flags=frozenset(found.enabled_flags),
            local_backward_classes=frozenset(found.local_backward_classes),
            instances=MappingProxyType(found.instances), mentions_float16=found.mentions_float16,
            returns=MappingProxyType({scope: frozenset(names) for scope, names in found.returns.items()}),
            methods=MappingProxyType(found.methods),
            module_scope=self.module_scope, imports_map=self.imports,
            name_references=MappingProxyType({name: tuple(nodes) for name, nodes in found.references.items()}),
            annotation_references=frozenset(found.annotation_references),
            calls_by_scope=calls_by_scope, assignments_by_scope=assignments_by_scope,
            scalers_by_scope=scopes.scalers([self.module_scope, *found.functions], self.module_scope, calls,
                                            assignments),
            positions=self.text)

    def qualified(self, node: ast.AST) -> frozenset[str]:
        names = self.names.get(node)
        if names is None:
            names = self.names[node] = self.imports.qualify(node)
        return names

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
            self.found.references.setdefault(name, []).append(node)

    # -- blocks and statements ----------------------------------------------------------
    def _block(self, body: list[ast.stmt], function: bool = False) -> None:
        if self.text.on_header_line(body[0]):  # `if x: return`: no block of its own
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
        self.found.functions.append(self.scope)
        if self.class_body is not None:
            self.found.methods[self.scope] = self.class_body
        class_body, self.class_body = self.class_body, None
        self.loops, self.autocasts, self.guards, self.scale_loss = [None], [None], [], [False]
        for decorator in node.decorator_list:
            self._decorator(decorator)
        self._bind(node.name, node)
        self.visit(node.args)
        if node.returns is not None:
            self._annotation(node.returns)
        self._block(node.body, function=True)
        self.class_body = class_body
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
            self._annotation(node.annotation)

    def _annotation(self, node: ast.expr) -> None:
        annotating, self.annotating = self.annotating, True
        self.visit(node)
        self.annotating = annotating

    def _ann_assign(self, node: ast.AnnAssign) -> None:
        self.visit(node.target)
        self._annotation(node.annotation)
        if node.value is not None:
            self.visit(node.value)
            if self.tests_version:
                self._version_flag(node.target, node.value)

    def _class(self, node: ast.ClassDef) -> None:
        bases = frozenset(n for base in node.bases for n in self.qualified(unstarred(base)))
        methods = {}
        for stmt in node.body:
            if stmt.__class__ in _FUNCTIONS:
                methods[stmt.name] = frozenset(n for d in stmt.decorator_list for n in self.qualified(_callee(d)))
        if "backward" in methods and not bases & _AUTOGRAD_FUNCTIONS:
            self.found.local_backward_classes.add(node.name)  # its backward is not torch's
        line, column = self.text.position(node)
        self.found.classes.append(ClassDef(node, bases, MappingProxyType(methods), line, column))
        for decorator in node.decorator_list:
            self._decorator(decorator)
        self._bind(node.name, node)
        self._visit_all(node.bases)
        self._visit_all(node.keywords)
        class_body, self.class_body = self.class_body, node.name
        self._block(node.body)
        self.class_body = class_body

    def _decorator(self, node: ast.expr) -> None:
        line, column = self.text.decorator_position(node)  # at the `@`, as the finding has always been
        self.found.decorators.append(Decorator(node, self.qualified(_callee(node)), line, column))
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
        return len(orelse) == 1 and first.__class__ is ast.If and self.text.source.startswith(
            "elif", self.text.offset(first.lineno, first.col_offset))

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
        catches = any(catches_compat(h) for h in node.handlers)
        self.compat.append(self.compat[-1] or catches)
        self._block(node.body)
        self.compat.pop()
        for handler in node.handlers:
            self.compat.append(self.compat[-1] or catches_compat(handler))
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
                self.version_tests[test] = self._is_version_test(test)
            if self.version_tests[test]:
                return True
        return False

    def _is_version_test(self, test: ast.expr) -> bool:
        """``test`` picks code by the torch version: as written (versions.VERSION_TEST), or
        through a name assigned from a version test."""
        return versions.VERSION_TEST.search(self.text.text(test)) is not None or self._reads_flag(test)

    def _reads_flag(self, expr: ast.expr) -> bool:
        if not self.version_flags:
            return False
        for node in ast.walk(expr):
            if node.__class__ in (ast.Name, ast.Attribute) and (name := dotted(node)) and self._is_flag(name):
                return True
        return False

    def _is_flag(self, name: str) -> bool:
        """``name`` holds a torch version test here (scoped as ``_context``)."""
        if "." not in name:
            for scope in (self.scope, *(saved[0] for saved in reversed(self.saved))):
                if scope.kind == "function" and (id(scope), name) in self.version_flags:
                    return True
        return (None, name) in self.version_flags

    def _version_flag(self, target: ast.expr, value: ast.expr) -> None:
        """``target = value``, where value tests the torch version: ``target`` is a version flag."""
        if value.__class__ not in _FLAG_VALUES:
            return
        if versions.TORCH_VALUE.search(self.text.text(value)) is None and not self._reads_flag(value):
            return
        for bound in _targets(target):
            name = dotted(bound)
            if name:
                self.version_flags.add((self._local_to(name), name))

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
            bound = dotted(call.func if call.__class__ is ast.Call else call)  # `with ctx:` / `with ctx():`
            held = self._context(bound) if bound else None
            if held is not None:  # a name the file assigned: what it holds, whatever an import of that name binds
                call = _entered(held, item.context_expr)
            elif call.__class__ in (ast.IfExp, ast.Subscript):  # `with autocast("cuda") if amp else nullcontext():`,
                call = autocasts.held_in(self.qualified, call)  # `with {"fp16": autocast(...), ...}[precision]:`
            elif call.__class__ is not ast.Call or autocasts.device(self.qualified, call.func) is False:
                call = None
            if call.__class__ is ast.Call and (device := autocasts.device(self.qualified, call.func)) is not False:
                block = autocasts.region(self.text, self.qualified, node, call, device, self.scope)
                self.found.autocasts.append(block)
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
        line, column = self.text.position(node)
        call = Call(node, self.qualified(func), method, receiver, self.scope, self.loops[-1],
                    self.autocasts[-1], self.statement, line, column,
                    feeds_backward=node in self.backward_receivers, guards=tuple(self.guards),
                    in_scale_loss=self.scale_loss[-1], block_exits=self.block_exits[-1], compat=self._in_compat())
        enabled = call.kwarg("enabled")
        if enabled is not None and call.names & _AMP_SWITCHES:
            self.found.enabled_flags.update(_flag_names(enabled))
        self.found.calls.append(call)
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
        if self.tests_version:
            for target in node.targets:
                self._version_flag(target, value)
        block = self.autocasts[-1]
        scaled = unwrap_cast(value)
        scaler = dotted(scaled.func.value) if _calls_method(scaled, "scale") else None
        for target in node.targets:
            if self.infer_dtypes:
                self._infer(target, value, block is not None and block.enabled, node.lineno)
            name = dotted(target)
            if not name:
                continue
            if scaler:
                self.found.scaled_values[(id(self.scope), name)] = scaler
            else:
                self.found.scaled_values.pop((id(self.scope), name), None)
            context = autocasts.held_in(self.qualified, value)
            if context is not None:
                self.contexts[(self._local_to(name), name)] = context
            call = value if value.__class__ is ast.Call else _conditional_call(value)
            if call is not None and call in self.by_node:
                self.found.assignments.append(Assignment(name, self.by_node[call]))
                callee = dotted(call.func)
                if callee in self.found.local_backward_classes:
                    self.found.instances[name] = callee

    def _local_to(self, name: str) -> int | None:
        """The function a plain name assigned here is local to; None at module level or for
        an attribute (``self.ctx``), which other functions and methods read."""
        return id(self.scope) if self.scope.kind == "function" and "." not in name else None

    def _context(self, name: str) -> ast.Call | None:
        """The autocast call ``name`` holds here: assigned in this function or one enclosing
        it, at module level, or as an attribute. Not another function's local of the same name:
        fastvit's ``train_one_epoch(..., amp_autocast=suppress)`` is no autocast because main()'s
        ``amp_autocast`` is one on some runs."""
        if "." not in name:
            for scope in (self.scope, *(saved[0] for saved in reversed(self.saved))):
                if scope.kind == "function" and (id(scope), name) in self.contexts:
                    return self.contexts[(id(scope), name)]
        return self.contexts.get((None, name))

    def _return(self, node: ast.Return) -> None:
        if node.value is not None:
            name = dotted(node.value)
            if name is not None and self.scope.kind == "function":
                self.found.returns.setdefault(self.scope, set()).add(name)  # `return net`: a factory
            self.visit(node.value)

    def _is_function(self, name: str) -> bool:
        root = name.split(".")[0]
        return root in self.imports.bound or root in self.functions

    def _dtype_of(self, name: str) -> str | None:
        return self.found.name_dtypes.get((id(self.scope), name), (None, 0))[0]

    def _infer(self, target: ast.expr, value: ast.expr, autocast: bool, line: int) -> None:
        """What ``target = value`` leaves each bound name holding (inference.py)."""
        elements = _targets(target)
        if len(elements) == 1 and elements[0] is target:
            pairs = [(target, self.inference.of(value, autocast))]
        elif value.__class__ in (ast.Tuple, ast.List) and len(value.elts) == len(target.elts):
            pairs = [(t, self.inference.of(v, autocast)) for t, v in zip(target.elts, value.elts, strict=True)]
        else:  # `a, b = model(x)`: a tuple of outputs, each of its own dtype
            dtype = self.inference.of(value, autocast, single=False)
            pairs = [(element, dtype) for element in elements]
        dtypes = self.found.name_dtypes
        for element, dtype in pairs:
            bound = dotted(element)
            if not bound:
                continue
            key = (id(self.scope), bound)
            if dtype is None:
                dtypes.pop(key, None)
            elif dtype != inference.LOW or dtypes.get(key, (None,))[0] != inference.LOW:
                dtypes[key] = (dtype, line)  # a low value keeps the line it first went low
        if value.__class__ is ast.Call and len(elements) == 1:
            module = next((n for n in self.qualified(value.func) if n.startswith("torch.nn.")), None)
            bound = dotted(target)
            if bound and module:
                self.nn_modules[bound] = module

    def _compare(self, node: ast.Compare) -> None:
        # `scaler.get_scale() != before`: kept for the skip-check rule; the sides are read there
        if len(node.ops) == 1 and node.ops[0].__class__ in (ast.NotEq, ast.Eq) \
                and (_calls_method(node.left, "get_scale") or _calls_method(node.comparators[0], "get_scale")):
            line, column = self.text.position(node)
            self.found.scale_comparisons.append(Comparison(node, line, column))
        self.visit(node.left)
        self._visit_all(node.comparators)

    def _binary(self, node: ast.BinOp) -> None:
        if node.op.__class__ in (ast.Add, ast.Sub):
            line, column = self.text.position(node)
            self.found.binary_ops.append(BinaryOp(node, line, column))
        self.visit(node.left)
        self.visit(node.right)

    def _attribute(self, node: ast.Attribute) -> None:
        if node.attr in _AMP_ATTRIBUTES:
            line, column = self.text.position(node)
            self.found.amp_references.append(Reference(node, self.qualified(node), line, column,
                                                       self._in_compat(), self.annotating))
        elif node.attr in _FLOAT16_ATTRIBUTES and self.qualified(node) & FLOAT16_NAMES:
            self.found.mentions_float16 = True
        self.visit(node.value)

    def _name(self, node: ast.Name) -> None:
        if node.id in self.tracked:
            self.found.references.setdefault(node.id, []).append(node)
            if self.annotating:
                self.found.annotation_references.add(id(node))
        elif node.id in self.float16_names:
            self.found.mentions_float16 = True

    def _dict(self, node: ast.Dict) -> None:
        for key, value in zip(node.keys, node.values, strict=True):  # in the order written
            if key is not None:
                self.visit(key)
            self.visit(value)

    def _import_from(self, node: ast.ImportFrom) -> None:
        if node.module is not None:
            self._bind(node.module.split(".")[0], node)  # `from amp import x` names `amp` too
        if node.module is None:
            return
        line, column = self.text.position(node)
        module = "." * node.level + node.module
        if node.names[0].name == "*":  # what it binds, where the lint knows: `from torch.cuda.amp import *`
            names = tuple((name, name) for name in star_names(module))
        else:
            names = tuple((a.name, a.asname or a.name) for a in node.names)
        self.found.imports.append(Import(node, module, names, line, column, self._in_compat()))

    def _import(self, node: ast.Import) -> None:
        line, column = self.text.position(node)
        for alias in node.names:
            bound = alias.asname or alias.name.split(".")[0]
            self.found.imports.append(Import(node, alias.name, ((alias.name, bound),), line, column,
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


_Handler = Callable[[Visitor, ast.AST], None]
_HANDLERS: dict[type, _Handler] = {
    ast.Call: Visitor._call, ast.Assign: Visitor._assign, ast.Compare: Visitor._compare,
    ast.BinOp: Visitor._binary, ast.Attribute: Visitor._attribute, ast.Name: Visitor._name,
    ast.IfExp: Visitor._if_expression, ast.Dict: Visitor._dict, ast.Return: Visitor._return,
    ast.FunctionDef: Visitor._function, ast.AsyncFunctionDef: Visitor._function,
    ast.arguments: Visitor._arguments, ast.ClassDef: Visitor._class,
    ast.If: Visitor._if, ast.For: Visitor._for, ast.AsyncFor: Visitor._for, ast.While: Visitor._while,
    ast.With: Visitor._with, ast.AsyncWith: Visitor._with, ast.Try: Visitor._try,
    ast.Import: Visitor._import, ast.ImportFrom: Visitor._import_from, ast.AnnAssign: Visitor._ann_assign,
    ast.Global: Visitor._global, ast.Nonlocal: Visitor._global, ast.Match: Visitor._match,
}
if hasattr(ast, "TryStar"):  # Python 3.11+
    _HANDLERS[ast.TryStar] = Visitor._try_star
# A file that imports nothing from the old AMP modules, nor float16 by name, reads no name:
# names are leaves
_WITHOUT_NAMES = {kind: handler for kind, handler in _HANDLERS.items() if kind is not ast.Name}

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
_AMP_SWITCHES = GRAD_SCALERS | frozenset(autocasts.AUTOCASTS)
_AUTOGRAD_FUNCTIONS = frozenset({"torch.autograd.Function", "torch.autograd.function.Function"})
_EXITS = (ast.Return, ast.Continue, ast.Break, ast.Raise)
# what a version flag is assigned from: a comparison, a call (`compare_version(...)`,
# `RequirementCache("torch>=2.4")`), `not`/`and`/`or` of them, another flag
_FLAG_VALUES = frozenset({ast.Compare, ast.Call, ast.BoolOp, ast.UnaryOp, ast.Name, ast.Attribute})
_AMP_ATTRIBUTES = frozenset({"autocast", "GradScaler", "custom_fwd", "custom_bwd"})
_FLOAT16_ATTRIBUTES = frozenset(name.rsplit(".", 1)[1] for name in FLOAT16_NAMES)  # torch.float16, torch.half

_SCOPE_OF_CALL = attrgetter("scope")
_SCOPE_OF_ASSIGNMENT = attrgetter("call.scope")


def _entered(held: ast.Call, entered: ast.expr) -> ast.Call:
    """The autocast call a ``with`` enters through a name that holds ``held``: ``with ctx:``
    enters it as it is; ``with autocast("cuda"):`` calls the function (or partial) it holds with
    more arguments, its own keywords winning."""
    if entered.__class__ is not ast.Call or not (entered.args or entered.keywords):
        return held
    keywords = {k.arg: k for k in held.keywords} | {k.arg: k for k in entered.keywords}
    return ast.Call(func=held.func, args=[*held.args, *entered.args], keywords=list(keywords.values()))


def _calls_method(node: ast.AST, method: str) -> bool:
    """``x.method(...)``."""
    return node.__class__ is ast.Call and node.func.__class__ is ast.Attribute and node.func.attr == method


def _callee(node: ast.expr) -> ast.expr:
    """What a decorator names: ``custom_fwd`` in ``@custom_fwd(...)`` and ``@custom_fwd``."""
    return node.func if node.__class__ is ast.Call else node


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
