"""Load a user's model (and example inputs) from a target spec - safely.

``PATH[:NAME_OR_EXPR]``: the file is imported only when its source statically defines an
entry point (or the user named one) and its top level runs none of the user's code
(``--exec`` lifts that); an EXPR is evaluated in the file's namespace after import.
``module.path:NAME_OR_EXPR`` imports an installed module; ``hf:MODEL_TYPE`` builds a small
transformers model (load/hf.py). Every failure is a :class:`LoadError` with a one-line cause.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import torch

from ampaudit.core.child_main import user_code
from ampaudit.core.config import project_root
from ampaudit.core.errors import USER_CODE_ERRORS, LoadError, ModelNotBuilt, NoModelFound, UsageError
from ampaudit.core.import_noise import quiet_imports
from ampaudit.core.listing import listed
from ampaudit.core.paths import display_path
from ampaudit.core.userframe import traceback_location
from ampaudit.graph.forward import ExampleInputs, describe_exception
from ampaudit.load.inputs import INPUT_FUNCTIONS, default_inputs, from_shapes
from ampaudit.load.isolation import shadows, user_folders
from ampaudit.load.source_scan import FACTORY_NAMES, MODEL_ATTRIBUTE, NotImported, SourceScan, not_imported, scan_source
from ampaudit.load.spec import NAME_RE, ModelSpec, parse_spec, read_source
from ampaudit.load.spectral_norm import ITERATIONS, converge_spectral_norms
from ampaudit.load.time_limit import DEFAULT_SECONDS, TimeLimitExceeded, time_limit


@dataclass
class LoadedModel:
    model: torch.nn.Module
    entry: str  # how it was obtained: "get_model()", "model", "SmallCNN()", "GPT(GPTConfig(n_layer=2))"
    inputs: ExampleInputs | None
    path: Path | None  # the model file; None for a module or hf: target
    label: str = ""  # what reports call the target: the file, or the spec as written
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.label:
            self.label = display_path(str(self.path)) if self.path is not None else self.entry


def load_target(
    spec: str | ModelSpec,
    *,
    allow_exec: bool = False,
    input_shapes: Sequence[str] = (),
    input_dtypes: Sequence[str] = (),
    model_config: Sequence[str] = (),
    import_timeout: float | None = DEFAULT_SECONDS,
) -> LoadedModel | NotImported:
    """Load the model a target spec names. ``import_timeout``: seconds the user's code
    (import, model build, ``example_inputs()``) may run; None or 0: no limit."""
    with quiet_imports():  # torchao's import-time log lines, which transformers' import brings
        return _load_target(spec, allow_exec, input_shapes, input_dtypes, model_config, import_timeout)


def _load_target(spec: str | ModelSpec, allow_exec: bool, input_shapes: Sequence[str], input_dtypes: Sequence[str],
                 model_config: Sequence[str], import_timeout: float | None) -> LoadedModel | NotImported:
    target = spec if isinstance(spec, ModelSpec) else parse_spec(spec)
    if model_config and target.kind != "hf":
        raise UsageError("--config KEY=VALUE sets fields of an hf:MODEL_TYPE model's config; "
                         f"{target.text} is not one")
    if target.kind == "hf":
        from ampaudit.load.hf import build_hf

        torch.manual_seed(0)
        model, entry = build_hf(target.module, model_config)
        return _finish(model, entry, None, target.text, input_shapes, input_dtypes, None)
    if target.kind == "module":
        with _limited(import_timeout, None, target.module):
            module = _import_module(target.module)
            torch.manual_seed(0)
            model, entry = _select(module, target, Path(target.module), None)  # hints say torch.nn:"..."
        return _finish(model, entry, None, target.module, input_shapes, input_dtypes, None)
    path, name = target.path, target.name
    scan = scan_source(path, read_source(path))
    if name is not None and name not in scan.names:
        raise LoadError(f"{path} defines no top-level {name!r}")
    if target.selector is None and not scan.has_entry_point:
        raise NoModelFound(_no_model_message(path))
    if (skipped := not_imported(scan, target.selector, allow_exec)) is not None:
        return skipped
    with _limited(import_timeout, path, str(path)):
        module = _import_file(path, scan)
        torch.manual_seed(0)  # same weights and example inputs on every run: a stable report
        if target.selector is None:
            model, entry = _resolve_model(module, scan, path)
        else:
            model, entry = _select(module, target, path, scan)
        file_inputs = None if input_shapes else _file_inputs(module)
    return _finish(model, entry, path, None, input_shapes, input_dtypes, file_inputs,
                   defaults=target.expr is not None)


@contextmanager
def _limited(seconds: float | None, path: Path | None, label: str) -> Iterator[None]:
    """Run the user's code under ``--import-timeout``; a stop says where it was stopped. In a
    child process (core/child.py) the parent keeps the clock and ``seconds`` is None here."""
    try:
        with user_code(f"importing {label}", path), time_limit(seconds):
            yield
    except TimeLimitExceeded as exc:
        line = _line_in(path, exc.__traceback__) if path is not None else None
        at = f" at line {line}" if line is not None else ""
        raise ModelNotBuilt(
            f"importing {label} was stopped after {seconds:g} s{at} (--import-timeout)",
            reason=f"importing the file or building its model was still running after {seconds:g} s, stopped{at}",
            hint='move long-running code under `if __name__ == "__main__":`, or raise --import-timeout',
            line=line) from None


def _finish(model: torch.nn.Module, entry: str, path: Path | None, label: str | None, input_shapes: Sequence[str],
            input_dtypes: Sequence[str], file_inputs: ExampleInputs | None, *, defaults: bool = True) -> LoadedModel:
    """Example inputs (the flags, the file's, or the model type's default) and eval mode; a
    ``torch.compile``'d model is audited and converted as the module it wraps."""
    notes: list[str] = []
    original = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(original, torch.nn.Module):
        model, entry = original, f"{entry}._orig_mod"
        notes.append("the model is torch.compile'd: the module it wraps (_orig_mod) was used")
    if input_shapes:
        inputs = from_shapes(input_shapes, input_dtypes)
    elif file_inputs is not None or not defaults:
        inputs = file_inputs
    else:
        inputs = default_inputs(model)
        if inputs is not None:
            try:
                with torch.no_grad():
                    model.eval()(*inputs.args, **inputs.kwargs)
            except USER_CODE_ERRORS as exc:
                notes.append(f"the default example inputs ({inputs.origin}) fail to run the model "
                             f"({describe_exception(exc)}): no inputs; pass --input-shape")
                inputs = None
    model.eval()  # the audit must not depend on dropout draws
    if iterated := converge_spectral_norms(model):
        notes.append(f"spectral_norm on {listed(iterated, 3)}: u and v never iterated (a freshly built model, whose "
                     f"eval forward divides by a random estimate of the norm): {ITERATIONS} power iterations "
                     "first, as training gives them")
    return LoadedModel(model, entry, inputs, path, label or "", notes)


def _import_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or name
        raise LoadError(f"cannot import {name}: no module named {missing!r} (is it installed? "
                        f"pip install {_PIP_NAMES.get(missing.split('.')[0], missing.split('.')[0])})") from exc
    except USER_CODE_ERRORS as exc:
        raise LoadError(f"importing {name} raised {describe_exception(exc)}") from exc


class _Namespace(dict):
    """Names an expression reads: the module's attributes, lazy ones too (transformers)."""

    def __init__(self, module: ModuleType) -> None:
        super().__init__()
        self.module = module

    def __missing__(self, key: str) -> Any:
        try:
            return getattr(self.module, key)
        except AttributeError:
            raise KeyError(key) from None


def _select(module: ModuleType, target: ModelSpec, path: Path, scan: SourceScan | None) -> tuple[torch.nn.Module, str]:
    """The model the user named after the colon: NAME, or EXPR evaluated in the module's namespace."""
    where = target.module if target.kind == "module" else str(path)
    if target.name is not None:
        if not hasattr(module, target.name):
            raise LoadError(f"{where} defines no top-level {target.name!r}")
        line = scan.lines.get(target.name) if scan is not None else None
        return _as_model(getattr(module, target.name), target.name, path, line)
    expr = target.expr
    try:
        code = compile(expr, f"<{target.text}>", "eval")
        value = eval(code, vars(module), _Namespace(module))  # the user's own expression, named on the command line
    except Exception as exc:
        raise LoadError(f"{expr} (in {where}) raised {describe_exception(exc)}") from exc
    return _as_model(value, expr, path)


def _no_model_message(path: Path) -> str:
    return (
        f"no model found in {path}: looked for a function {'/'.join(FACTORY_NAMES)}, a module-level "
        f"`{MODEL_ATTRIBUTE}`, or an nn.Module subclass constructible with no arguments; "
        f"name one with {path}:NAME"
    )


def _package_root(path: Path) -> tuple[Path, str] | None:
    """For a file inside a package (folders with __init__.py): the folder above the top
    package, and the file's dotted module name (``mingpt/model.py`` -> ``mingpt.model``)."""
    folder, parts = path.resolve().parent, [path.stem]
    while (folder / "__init__.py").is_file() and NAME_RE.match(folder.name):
        parts.insert(0, folder.name)
        folder = folder.parent
    return (folder, ".".join(parts)) if len(parts) > 1 else None


def _import_file(path: Path, scan: SourceScan) -> ModuleType:
    folders = [path.resolve().parent]  # so the model file can import its siblings
    package = _package_root(path)
    if package is not None:
        folders.append(package[0])  # ... and its own package (`from mingpt.utils import ...`)
    own_name = NAME_RE.match(path.stem) is not None and not shadows(path.stem, folders)
    with user_folders(folders):
        return _exec_file(path, scan, package, own_name)


def _exec_file(path: Path, scan: SourceScan, package: tuple[Path, str] | None, own_name: bool) -> ModuleType:
    if package is not None and scan.relative_imports and package[1] not in sys.modules:
        module_name = package[1]  # `from .layers import ...` needs the package
        try:
            importlib.import_module(module_name.rsplit(".", 1)[0])
        except USER_CODE_ERRORS as exc:  # the package's __init__ failed: say so like the file's own
            raise _import_failure(path, exc) from exc
    elif own_name and path.stem not in sys.modules:
        module_name = path.stem  # reports name the user's functions `model.attention`, as they would
    else:
        module_name = f"_ampaudit_target_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise LoadError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except USER_CODE_ERRORS as exc:
        sys.modules.pop(module_name, None)
        raise _import_failure(path, exc) from exc
    return module


def _line_in(path: Path, tb: TracebackType | None) -> int | None:
    """The innermost line of ``path`` in a traceback (the import, call or statement that failed)."""
    target, line = str(path.resolve()), None
    while tb is not None:
        if str(Path(tb.tb_frame.f_code.co_filename).resolve()) == target:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


_PIP_NAMES = {"cv2": "opencv-python", "PIL": "pillow", "sklearn": "scikit-learn", "yaml": "pyyaml",
              "skimage": "scikit-image", "attr": "attrs"}


def _import_failure(path: Path, exc: BaseException) -> ModelNotBuilt:
    line = _line_in(path, exc.__traceback__)
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        where = traceback_location(exc.__traceback__)
        at = f" ({display_path(where[0])}:{where[1]})" if where else ""
        top = exc.name.split(".")[0]
        holder = _project_folder_holding(top, path)
        if holder is not None:
            hint = (f"`{top}` is part of this project: run ampaudit from the folder that contains it "
                    f"({display_path(str(holder))}), or put that folder on PYTHONPATH")
        else:
            pip = f" (pip install {_PIP_NAMES[top]})" if top in _PIP_NAMES else ""
            hint = f"install `{top}`{pip} to audit the graph"
        return ModelNotBuilt(f"cannot import {path}: no module named {exc.name!r}{at}",
                             reason=f"no module named {exc.name!r}", hint=hint, line=line)
    if isinstance(exc, SystemExit):
        return ModelNotBuilt(f"importing {path} called exit({exc.code!r})",
                             reason=f"importing the file called exit({exc.code!r})",
                             hint='move that call under `if __name__ == "__main__":` to audit the graph', line=line)
    text = describe_exception(exc)
    if "CUDA" in text or "NVIDIA" in text:
        hint = ('this machine has no usable CUDA: move the `.cuda()` / device code under `if __name__ == '
                '"__main__":`, or run where CUDA works, to audit the graph')
    else:
        hint = 'fix that, or move the code that fails under `if __name__ == "__main__":`, to audit the graph'
    return ModelNotBuilt(f"importing {path} raised {text}", reason=f"importing the file raised {text}", hint=hint,
                         line=line)


def _project_folder_holding(top: str, path: Path) -> Path | None:
    """The folder, from ``path``'s own up to its project's root (core/config.project_root), that
    holds module ``top``: ``top.py``, a package ``top/__init__.py`` or - inside a project that has
    a root - a folder of modules ``top/*.py``. None when there is none: a folder of that name
    alone (empty, or another checkout above the project) says nothing of where ``top`` is."""
    folder = path.resolve().parent
    root = project_root(folder)
    for parent in (folder, *folder.parents):
        package = parent / top
        if (parent / f"{top}.py").is_file() or (package / "__init__.py").is_file() or (
                root is not None and package.is_dir() and any(package.glob("*.py"))):
            return parent
        if parent == root:
            break
    return None


def _call(fn: Any, label: str, path: Path) -> Any:
    try:
        return fn()
    except USER_CODE_ERRORS as exc:
        text = f"{label} raised {describe_exception(exc)}"
        raise ModelNotBuilt(text, reason=text, hint=f'name a model that builds: {path}:NAME or {path}:"EXPR"',
                            line=_line_in(path, exc.__traceback__)) from exc


def _needs_arguments(fn: Any) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _needs_arguments_error(label: str, missing: list[str], path: Path, line: int | None) -> ModelNotBuilt:
    reason = f"{label}() needs arguments ({', '.join(missing)})"
    return ModelNotBuilt(f'{reason}: name a factory or an instance, or an expression ({path}:"{label}(...)")',
                         reason=reason, hint=f'name it with an expression: {path}:"{label}(...)"', line=line)


def _as_model(value: Any, label: str, path: Path, line: int | None = None) -> tuple[torch.nn.Module, str]:
    """Turn an instance, a no-arg class or a zero-arg factory into a module."""
    if isinstance(value, torch.nn.Module):
        return value, label
    if callable(value):
        missing = _needs_arguments(value)
        if missing:
            raise _needs_arguments_error(label, missing, path, line)
        label = f"{label}()"
        value = _call(value, label, path)
    if not isinstance(value, torch.nn.Module):
        raise LoadError(f"{label} is {type(value).__name__}, not an nn.Module")
    return value, label


def _resolve_model(module: ModuleType, scan: SourceScan, path: Path) -> tuple[torch.nn.Module, str]:
    """The file's own entry point: a factory, `model`, or the outermost nn.Module class."""
    for factory in scan.factories:
        if callable(getattr(module, factory, None)):
            return _as_model(getattr(module, factory), factory, path, scan.lines.get(factory))
    if isinstance(getattr(module, MODEL_ATTRIBUTE, None), torch.nn.Module):
        return getattr(module, MODEL_ATTRIBUTE), MODEL_ATTRIBUTE
    classes = [
        obj for cls_name in scan.classes
        if isinstance(obj := getattr(module, cls_name, None), type)
        and issubclass(obj, torch.nn.Module) and obj.__module__ == module.__name__
    ]

    # The model is a class no other class of the file builds: Net, not the FusedNorm that Net contains.
    def built_by_another(cls: type) -> bool:
        return any(cls.__name__ in scan.class_refs.get(o.__name__, ()) for o in classes if o is not cls)

    roots = [cls for cls in classes if not built_by_another(cls)] or classes
    ready = [cls for cls in roots if not _needs_arguments(cls)]
    if len(ready) == 1:
        return _as_model(ready[0], ready[0].__name__, path)
    if len(ready) > 1:
        names = ", ".join(cls.__name__ for cls in ready)
        reason = f"the file defines several nn.Module classes ({names})"
        raise ModelNotBuilt(f"{path} defines several nn.Module classes ({names}): name one with {path}:NAME",
                            reason=reason, hint=f"name one with {path}:NAME", line=scan.lines.get(ready[0].__name__))
    if len(roots) == 1:
        cls = roots[0]
        raise _needs_arguments_error(cls.__name__, _needs_arguments(cls), path, scan.lines.get(cls.__name__))
    if roots:
        names = ", ".join(cls.__name__ for cls in roots)
        reason = f"the nn.Module classes {names} all need arguments"
        raise ModelNotBuilt(f"{path}: {reason}: name one with an expression ({path}:\"{roots[0].__name__}(...)\")",
                            reason=reason, hint=f'name one with an expression: {path}:"{roots[0].__name__}(...)"',
                            line=scan.lines.get(roots[0].__name__))
    raise NoModelFound(_no_model_message(path))


def _file_inputs(module: ModuleType) -> ExampleInputs | None:
    for name in INPUT_FUNCTIONS:
        value = getattr(module, name, None)
        if value is None:
            continue
        if callable(value):
            return ExampleInputs.coerce(_call_inputs(value, f"{name}()"), f"{name}()")
        return ExampleInputs.coerce(value, name)
    return None


def _call_inputs(fn: Any, label: str) -> Any:
    try:
        return fn()
    except USER_CODE_ERRORS as exc:
        raise LoadError(f"{label} raised {describe_exception(exc)}") from exc
