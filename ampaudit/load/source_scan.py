"""Read a model file without running it: which entry points it defines, and whether its
top level is safe to import.

Safe means: every top-level statement only imports, defines (``def``/``class``: their
decorators, default arguments, bases and class bodies included), assigns a value that
runs no code of the user's, or builds a model (``model = Net(...)``), and ``if``/``try``
blocks are made of those; ``if __name__ == "__main__":`` never runs on import. A call is
safe only when it is known to be pure (``int``, ``os.path.join``, ``torch.device``,
``torch.nn.Linear``, ``dataclass``, an ``nn.Module`` class of the file...): ``result =
train()``, a default argument or ``if`` test that calls the file's own code, a decorator
that is not known to be pure, a loop or a ``with`` block all run code, and the file is not
imported (AMP003) unless the user passes ``--exec``.

This is what lets ``ampaudit check train.py`` never start a training run by accident.
"""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass, field
from pathlib import Path

from ampaudit.core.errors import LoadError
from ampaudit.core.paths import display_path
from ampaudit.core.python_source import TOO_DEEP, parse_python, run_deep, syntax_reason

FACTORY_NAMES = ("get_model", "build_model", "create_model", "make_model")
MODEL_ATTRIBUTE = "model"


@dataclass
class SourceScan:
    path: Path
    names: set[str] = field(default_factory=set)  # every top-level name bound by def/class/assign/import
    imported: set[str] = field(default_factory=set)  # the top-level names bound only by an import
    imported_from: dict[str, str] = field(default_factory=dict)  # `from timm import create_model`: name -> module
    factories: list[str] = field(default_factory=list)  # FACTORY_NAMES the file defines, in lookup order
    has_model_attribute: bool = False
    classes: list[str] = field(default_factory=list)
    class_refs: dict[str, set[str]] = field(default_factory=dict)  # class -> names its body mentions
    lines: dict[str, int] = field(default_factory=dict)  # def/class name -> its line
    relative_imports: bool = False  # `from . import x`: the file must be imported as part of its package
    unsafe: tuple[int, int, str] | None = None  # (line, col, what) of the first code that runs on import

    @property
    def has_entry_point(self) -> bool:
        return bool(self.factories or self.has_model_attribute or self.classes)


def _is_main_guard(node: ast.If) -> bool:
    test = node.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    consts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and consts == ["__main__"]


_WHAT = {
    ast.For: "a for loop", ast.AsyncFor: "a for loop", ast.While: "a while loop", ast.With: "a with block",
    ast.AsyncWith: "a with block", ast.Expr: "a call", ast.Assert: "an assert", ast.Raise: "a raise",
    ast.Delete: "a del", ast.Match: "a match statement",
}


# Base classes that rule a class out as a model: autograd Functions, datasets, enums...
_NON_MODULE_BASES = frozenset({
    "Function", "Exception", "BaseException", "Enum", "IntEnum", "StrEnum", "Flag", "Dataset", "IterableDataset",
    "NamedTuple", "TypedDict", "Protocol", "ABC", "object", "Sampler", "Optimizer", "LRScheduler", "_LRScheduler",
})


def _not_a_module(base: ast.expr) -> bool:
    name = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else None
    return name is not None and (name in _NON_MODULE_BASES or name.endswith(("Error", "Exception")))


def _bound_names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _bound_names(elt)]
    if isinstance(target, ast.Starred):
        return _bound_names(target.value)
    return []


# --- what may run on import -------------------------------------------------------------------

# Calls known to run none of the user's code and to start nothing: qualified names, and
# prefixes (ending in ".") of whole namespaces.
_PURE_CALLS = frozenset({
    *(f"builtins.{n}" for n in (
        "int", "float", "str", "bool", "bytes", "complex", "len", "sorted", "reversed", "tuple", "list", "dict",
        "set", "frozenset", "range", "min", "max", "abs", "round", "sum", "any", "all", "isinstance", "issubclass",
        "hasattr", "getattr", "callable", "type", "enumerate", "zip", "repr", "format", "hash", "divmod", "pow",
        "chr", "ord", "bin", "hex", "oct", "slice", "object", "property", "staticmethod", "classmethod", "id",
        "vars", "dir")),
    "os.getenv", "os.environ.get", "os.environ.setdefault", "os.cpu_count", "os.getcwd", "os.getpid",
    "sys.path.append", "sys.path.insert", "pathlib.Path", "pathlib.PurePath", "re.compile",
    "logging.getLogger", "logging.basicConfig", "warnings.filterwarnings", "warnings.simplefilter",
    "collections.namedtuple", "collections.OrderedDict", "collections.defaultdict", "collections.Counter",
    "dataclasses.field", "dataclasses.dataclass", "functools.partial", "enum.auto",
    "contextlib.nullcontext", "packaging.version.parse", "packaging.version.Version",
    "numpy.array", "numpy.asarray", "numpy.finfo", "numpy.iinfo", "numpy.dtype", "numpy.sqrt", "numpy.log",
    "torch.device", "torch.finfo", "torch.iinfo", "torch.Size", "torch.tensor", "torch.zeros", "torch.ones",
    "torch.empty", "torch.full", "torch.arange", "torch.linspace", "torch.eye", "torch.randn", "torch.rand",
    "torch.randint", "torch.cuda.is_available", "torch.cuda.device_count", "torch.cuda.is_bf16_supported",
    "torch.backends.mps.is_available", "torch.backends.cudnn.is_available", "torch.get_default_dtype",
    "torch.manual_seed", "torch.set_default_dtype", "torch.set_float32_matmul_precision", "torch.compile",
    "torch.amp.GradScaler", "torch.cuda.amp.GradScaler", "torch.amp.autocast", "torch.autocast",
    "torch.cuda.amp.autocast", "torch.no_grad", "torch.inference_mode", "torch.enable_grad",
})
_PURE_PREFIXES = ("os.path.", "math.", "typing.", "typing_extensions.", "itertools.", "torch.nn.", "torch.optim.",
                  "torch.jit.", "torch.fx.wrap")
# Decorators: applying one of these defines, wraps or compiles; it trains nothing.
_PURE_DECORATORS = frozenset({
    "builtins.staticmethod", "builtins.classmethod", "builtins.property", "dataclasses.dataclass",
    "abc.abstractmethod", "contextlib.contextmanager", "enum.unique",
})
_PURE_DECORATOR_PREFIXES = ("torch.", "functools.", "typing.", "typing_extensions.")
# Methods harmless on whatever they are called on (strings, paths, dicts).
_PURE_METHODS = frozenset({
    "split", "rsplit", "join", "format", "lower", "upper", "strip", "lstrip", "rstrip", "replace", "startswith",
    "endswith", "islower", "isupper", "isdigit", "isalpha", "partition", "rpartition", "splitlines", "title",
    "zfill", "encode", "decode", "keys", "values", "items", "copy", "resolve", "absolute", "expanduser",
    "joinpath", "with_suffix", "with_name", "relative_to", "as_posix", "exists", "is_file", "is_dir",
})
# nn.Module methods allowed on a model the top level builds: `model = Net().to(device)`.
_MODULE_METHODS = frozenset({
    "to", "cuda", "cpu", "eval", "half", "float", "bfloat16", "double", "requires_grad_", "parameters",
    "named_parameters", "buffers", "named_buffers", "modules", "named_modules", "children", "state_dict",
})
_CONFIG_BASES = frozenset({"NamedTuple", "Enum", "IntEnum", "StrEnum", "TypedDict"})


def _label(node: ast.AST, limit: int = 40) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Guard:
    """Finds the first expression or statement that would run code on import."""

    def __init__(self, tree: ast.Module) -> None:
        self.aliases: dict[str, str] = {}  # name -> qualified name it imports
        self.defined: set[str] = set()  # names a top-level def/class binds
        self.assigned: set[str] = set()  # names a top-level assignment binds
        self.constructors: set[str] = set()  # the file's classes whose construction is pure
        self.models: set[str] = set()  # names bound to a model the top level builds
        self._bindings(tree.body)
        self._constructors(tree.body)

    # -- what the names are ------------------------------------------------------------------

    def _bindings(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.Import):
                for a in stmt.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        head = a.name.split(".")[0]
                        self.aliases[head] = head
            elif isinstance(stmt, ast.ImportFrom):
                module = "." * stmt.level + (stmt.module or "")
                for a in stmt.names:
                    self.aliases[a.asname or a.name] = f"{module}.{a.name}" if module else a.name
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defined.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for target in targets:
                    self.assigned.update(_bound_names(target))
            elif isinstance(stmt, ast.If) and not _is_main_guard(stmt):
                self._bindings(stmt.body)
                self._bindings(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                for block in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                    self._bindings(block)

    def _constructors(self, body: list[ast.stmt]) -> None:
        # nn.Module subclasses (through torch.nn or another such class of the file), dataclasses
        # and named tuples: building one runs only its __init__, which defines layers.
        classes = [s for s in body if isinstance(s, ast.ClassDef)]
        changed = True
        while changed:
            changed = False
            for cls in classes:
                if cls.name in self.constructors:
                    continue
                bases = [self.qualify(b) or "" for b in cls.bases]
                decorators = [self.qualify(d.func if isinstance(d, ast.Call) else d) for d in cls.decorator_list]
                if (any(b.startswith("torch.nn.") or (b.startswith("local.") and b[6:] in self.constructors)
                        for b in bases)
                        or "dataclasses.dataclass" in decorators
                        or any(b.rsplit(".", 1)[-1] in _CONFIG_BASES for b in bases)):
                    self.constructors.add(cls.name)
                    changed = True

    def qualify(self, node: ast.AST) -> str | None:
        """``nn.Linear`` -> ``torch.nn.Linear`` through the file's imports; ``local.NAME`` for
        the file's own names; ``builtins.NAME``; None for anything else."""
        if isinstance(node, ast.Name):
            name = node.id
            if name in self.defined or (name in self.assigned and name not in self.aliases):
                return f"local.{name}"
            if name in self.aliases:
                return self.aliases[name]
            return f"builtins.{name}" if hasattr(builtins, name) else None
        if isinstance(node, ast.Attribute):
            base = self.qualify(node.value)
            return f"{base}.{node.attr}" if base is not None else None
        return None

    def _is_module_chain(self, node: ast.expr) -> bool:
        """A model the top level builds: ``Net(...)``, ``model``, ``Net().to(device)``."""
        if isinstance(node, ast.Name):
            return node.id in self.models
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _MODULE_METHODS:
                return self._is_module_chain(func.value)
            q = self.qualify(func) or ""
            return (q.startswith("local.") and q[6:] in self.constructors) or (
                q.startswith("torch.nn.") and q.rsplit(".", 1)[-1][:1].isupper())
        return False

    # -- is this call pure ---------------------------------------------------------------------

    def _pure_call(self, call: ast.Call) -> bool:
        func = call.func
        q = self.qualify(func)
        if q is not None:
            if q in _PURE_CALLS or q.startswith(_PURE_PREFIXES):
                return True
            if q.startswith("local.") and q[6:] in self.constructors:
                return True
            if q.startswith("transformers.") and q.count(".") == 1 and q[13:14].isupper():
                return True  # a transformers config or model class, built from a config: no download
        if isinstance(func, ast.Attribute):
            if func.attr in _MODULE_METHODS and self._is_module_chain(func.value):
                return True
            # A harmless method on a value (not on an imported module: `requests.get` is not pure).
            if func.attr in _PURE_METHODS and not self._is_import_chain(func.value):
                return True
        return False

    def _is_import_chain(self, node: ast.expr) -> bool:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.aliases or node.id in self.defined:
            return False
        return not any(p.startswith("__") and p.endswith("__") for p in parts)  # torch.__version__ is a str

    def impure(self, node: ast.AST | None, context: str = "") -> tuple[int, int, str] | None:
        """The first call in ``node`` that is not known to be pure: (line, col, what)."""
        if node is None:
            return None
        if isinstance(node, ast.Lambda):  # the body runs later; the defaults now
            return self._first(node.args.defaults + [d for d in node.args.kw_defaults if d is not None], context)
        if isinstance(node, ast.Call) and not self._pure_call(node):
            return node.lineno, node.col_offset + 1, f"a call to `{_label(node.func)}()`{context}"
        return self._first(list(ast.iter_child_nodes(node)), context)

    def _first(self, nodes, context: str = "") -> tuple[int, int, str] | None:
        for child in nodes:
            found = self.impure(child, context)
            if found:
                return found
        return None

    def _decorators(self, decorators: list[ast.expr]) -> tuple[int, int, str] | None:
        for deco in decorators:
            target = deco.func if isinstance(deco, ast.Call) else deco
            q = self.qualify(target) or ""
            pure = (q in _PURE_DECORATORS or q.startswith(_PURE_DECORATOR_PREFIXES)
                    or (isinstance(target, ast.Attribute) and target.attr in ("setter", "getter", "deleter")))
            if not pure:
                return deco.lineno, deco.col_offset + 1, f"the decorator `@{_label(deco)}`"
            found = self._first(deco.args + [k.value for k in deco.keywords]) if isinstance(deco, ast.Call) else None
            if found:
                return found
        return None

    def _function(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[int, int, str] | None:
        args = fn.args
        defaults = args.defaults + [d for d in args.kw_defaults if d is not None]
        return self._decorators(fn.decorator_list) or self._first(defaults, " in a default argument")

    def _class(self, cls: ast.ClassDef) -> tuple[int, int, str] | None:
        return (self._decorators(cls.decorator_list)
                or self._first(cls.bases + [k.value for k in cls.keywords], " in the class bases")
                or self.block(cls.body, in_class=True))

    # -- statements ----------------------------------------------------------------------------

    def block(self, body: list[ast.stmt], in_class: bool = False) -> tuple[int, int, str] | None:
        for stmt in body:
            found = self.statement(stmt, in_class)
            if found:
                return found
        return None

    def statement(self, stmt: ast.stmt, in_class: bool) -> tuple[int, int, str] | None:
        if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.Pass, ast.Global, ast.Nonlocal)):
            return None
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return self._function(stmt)
        if isinstance(stmt, ast.ClassDef):
            return self._class(stmt)
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            found = self.impure(stmt.value) or self._first(
                [t for t in targets if not isinstance(t, (ast.Name, ast.Tuple, ast.List))])
            if found is None and not in_class and isinstance(stmt, ast.Assign) and stmt.value is not None \
                    and self._is_module_chain(stmt.value):
                self.models.update(n for t in targets for n in _bound_names(t))
            return found
        if isinstance(stmt, ast.If):
            if not in_class and _is_main_guard(stmt):
                return None  # never runs on import
            return (self.impure(stmt.test, " in an if test") or self.block(stmt.body, in_class)
                    or self.block(stmt.orelse, in_class))
        if isinstance(stmt, ast.Try):  # try: import x / except ImportError: x = None
            return (self.block(stmt.body, in_class)
                    or self._first([h.type for h in stmt.handlers if h.type is not None])
                    or next(filter(None, (self.block(h.body, in_class) for h in stmt.handlers)), None)
                    or self.block(stmt.orelse, in_class) or self.block(stmt.finalbody, in_class))
        if isinstance(stmt, ast.Expr):
            if isinstance(stmt.value, ast.Constant):
                return None  # docstring or ellipsis
            if isinstance(stmt.value, ast.Call):  # sys.path.insert(...), warnings.filterwarnings(...)
                return self.impure(stmt.value)
        return stmt.lineno, stmt.col_offset + 1, _WHAT.get(type(stmt), type(stmt).__name__.lower())


# --- the scan -----------------------------------------------------------------------------


def _scan_block(body: list[ast.stmt], scan: SourceScan) -> None:
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            bound = {(a.asname or a.name).split(".")[0] for a in stmt.names}
            scan.names.update(bound)
            scan.imported.update(bound)
            if isinstance(stmt, ast.ImportFrom) and stmt.level:
                scan.relative_imports = True
            elif isinstance(stmt, ast.ImportFrom) and stmt.module:
                scan.imported_from.update({a.asname or a.name: stmt.module for a in stmt.names})
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scan.names.add(stmt.name)
            scan.lines.setdefault(stmt.name, stmt.lineno)
        elif isinstance(stmt, ast.ClassDef):
            scan.names.add(stmt.name)
            scan.lines.setdefault(stmt.name, stmt.lineno)
            if stmt.bases and not all(_not_a_module(b) for b in stmt.bases):
                scan.classes.append(stmt.name)
                scan.class_refs[stmt.name] = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                scan.names.update(_bound_names(target))
        elif isinstance(stmt, ast.If):
            if _is_main_guard(stmt):
                continue  # never runs on import
            _scan_block(stmt.body, scan)
            _scan_block(stmt.orelse, scan)
        elif isinstance(stmt, ast.Try):
            _scan_block(stmt.body, scan)
            for handler in stmt.handlers:
                _scan_block(handler.body, scan)
            _scan_block(stmt.orelse, scan)
            _scan_block(stmt.finalbody, scan)


@dataclass
class NotImported:
    """The file defines a model but running its top level would do more than define it."""

    path: Path
    entry: str
    line: int
    column: int
    what: str  # "a for loop", "a call", ...


def static_entry(scan: SourceScan) -> str:
    """The entry point the file's source names, as a report shows it."""
    if scan.factories:
        return f"{scan.factories[0]}()"
    if scan.has_model_attribute:
        return MODEL_ATTRIBUTE
    return f"{scan.classes[0]}()" if len(scan.classes) == 1 else "an nn.Module class"


def not_imported(scan: SourceScan, selector: str | None, allow_exec: bool) -> NotImported | None:
    """Whether the file stays unimported (AMP003): its top level runs code and ``--exec`` was
    not passed. Decided from the source alone, so a caller can answer before importing torch."""
    if scan.unsafe is None or allow_exec:
        return None
    line, column, what = scan.unsafe
    return NotImported(scan.path, selector or static_entry(scan), line, column, what)


def scan_source(path: Path, source: str) -> SourceScan:
    """Parse ``source``; a syntax error becomes a LoadError naming file:line. The walk is
    recursive: deeply nested valid code gets a deep stack (core/python_source.run_deep), and
    code nested deeper still a LoadError, as the lint says of it (check/lint_file.py)."""
    try:
        return run_deep(_scan_source, path, source)
    except RecursionError:  # the parser's, or the walk's: the file, not ampaudit, is at fault
        raise LoadError(f"{display_path(str(path))}: {TOO_DEEP}") from None


def _scan_source(path: Path, source: str) -> SourceScan:
    try:
        tree = parse_python(source, str(path))
    except SyntaxError as exc:
        raise LoadError(f"syntax error in {path}:{exc.lineno}:{exc.offset or 0}: {syntax_reason(exc)}") from exc
    except ValueError as exc:  # null bytes
        raise LoadError(f"cannot parse {path}: {exc}") from exc
    scan = SourceScan(path)
    _scan_block(tree.body, scan)
    guard = _Guard(tree)
    # A name only imported (`from timm import create_model`) is not this file's entry point.
    scan.imported -= guard.defined | guard.assigned
    defined_here = scan.names - scan.imported
    scan.factories = [name for name in FACTORY_NAMES if name in defined_here]
    scan.has_model_attribute = MODEL_ATTRIBUTE in defined_here
    scan.unsafe = guard.block(tree.body)
    return scan
