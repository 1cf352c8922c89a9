"""Load a user's model (and example inputs) from ``PATH[:NAME]`` - safely.

The file is imported only when its source statically defines an entry point (or the user
named one) and its top level only imports, defines, assigns and guards; ``--exec`` lifts
the second condition. Every failure is a :class:`LoadError` with a one-line cause.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ampaudit.core.errors import LoadError, NoModelFound
from ampaudit.core.paths import display_path
from ampaudit.graph.forward import ExampleInputs, describe_exception
from ampaudit.graph.userframe import traceback_location
from ampaudit.load.inputs import INPUT_FUNCTIONS, from_shapes
from ampaudit.load.source_scan import FACTORY_NAMES, MODEL_ATTRIBUTE, SourceScan, scan_source
from ampaudit.load.spec import NAME_RE, parse_target, read_source


@dataclass
class LoadedModel:
    model: torch.nn.Module
    entry: str  # how it was obtained: "get_model()", "model", "SmallCNN()"
    inputs: ExampleInputs | None
    path: Path


@dataclass
class NotImported:
    """The file defines a model but running its top level would do more than define it."""

    path: Path
    entry: str
    line: int
    column: int
    what: str  # "a for loop", "a call", ...


def load_target(
    spec: str,
    *,
    allow_exec: bool = False,
    input_shapes: Sequence[str] = (),
    input_dtypes: Sequence[str] = (),
) -> LoadedModel | NotImported:
    path, name = parse_target(spec)
    scan = scan_source(path, read_source(path))
    if name is not None and name not in scan.names:
        raise LoadError(f"{path} defines no top-level {name!r}")
    if name is None and not scan.has_entry_point:
        raise NoModelFound(_no_model_message(path))
    if scan.unsafe is not None and not allow_exec:
        line, column, what = scan.unsafe
        return NotImported(path, name or _static_entry(scan), line, column, what)
    module = _import_file(path)
    torch.manual_seed(0)  # same weights and example inputs on every run: a stable report
    model, entry = _resolve_model(module, scan, name, path)
    inputs = from_shapes(input_shapes, input_dtypes) if input_shapes else _file_inputs(module)
    model.eval()  # the audit must not depend on dropout draws
    return LoadedModel(model, entry, inputs, path)


def _static_entry(scan: SourceScan) -> str:
    if scan.factories:
        return f"{scan.factories[0]}()"
    if scan.has_model_attribute:
        return MODEL_ATTRIBUTE
    return f"{scan.classes[0]}()" if len(scan.classes) == 1 else "an nn.Module class"


def _no_model_message(path: Path) -> str:
    return (
        f"no model found in {path}: looked for a function {'/'.join(FACTORY_NAMES)}, a module-level "
        f"`{MODEL_ATTRIBUTE}`, or an nn.Module subclass constructible with no arguments; "
        f"name one with {path}:NAME"
    )


def _import_file(path: Path) -> ModuleType:
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so the model file can import its siblings
    module_name = path.stem if NAME_RE.match(path.stem) and path.stem not in sys.modules else (
        f"_ampaudit_target_{abs(hash(str(path.resolve())))}")
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise LoadError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as exc:
        sys.modules.pop(module_name, None)
        where = traceback_location(exc.__traceback__)
        at = f" ({display_path(where[0])}:{where[1]})" if where else ""
        raise LoadError(f"cannot import {path}: no module named {exc.name!r}{at}") from exc
    except SystemExit as exc:
        sys.modules.pop(module_name, None)
        raise LoadError(f"importing {path} called exit({exc.code!r})") from exc
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise LoadError(f"importing {path} raised {describe_exception(exc)}") from exc
    return module


def _call(fn: Any, label: str) -> Any:
    try:
        return fn()
    except Exception as exc:
        raise LoadError(f"{label} raised {describe_exception(exc)}") from exc


def _needs_arguments(cls: type) -> list[str]:
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _as_model(value: Any, label: str) -> tuple[torch.nn.Module, str]:
    """Turn an instance, a no-arg class or a zero-arg factory into a module."""
    if isinstance(value, torch.nn.Module):
        return value, label
    if isinstance(value, type) and issubclass(value, torch.nn.Module):
        missing = _needs_arguments(value)
        if missing:
            raise LoadError(f"{label}() needs arguments ({', '.join(missing)}): name a factory or an instance")
        label = f"{label}()"
        value = _call(value, label)
    elif callable(value):
        label = f"{label}()"
        value = _call(value, label)
    if not isinstance(value, torch.nn.Module):
        raise LoadError(f"{label} is {type(value).__name__}, not an nn.Module")
    return value, label


def _resolve_model(module: ModuleType, scan: SourceScan, name: str | None, path: Path):
    if name is not None:
        if not hasattr(module, name):
            raise LoadError(f"{path} defines no top-level {name!r}")
        return _as_model(getattr(module, name), name)
    for factory in scan.factories:
        if callable(getattr(module, factory, None)):
            return _as_model(getattr(module, factory), factory)
    if isinstance(getattr(module, MODEL_ATTRIBUTE, None), torch.nn.Module):
        return getattr(module, MODEL_ATTRIBUTE), MODEL_ATTRIBUTE
    classes = [
        obj for cls_name in scan.classes
        if isinstance(obj := getattr(module, cls_name, None), type)
        and issubclass(obj, torch.nn.Module) and obj.__module__ == module.__name__
    ]
    ready = [cls for cls in classes if not _needs_arguments(cls)]
    if len(ready) > 1:
        # Prefer the class no other candidate builds: Net, not the FusedNorm that Net contains.
        def built_by_another(cls: type) -> bool:
            return any(cls.__name__ in scan.class_refs.get(o.__name__, ()) for o in ready if o is not cls)

        roots = [cls for cls in ready if not built_by_another(cls)]
        ready = roots or ready
    if len(ready) == 1:
        return _as_model(ready[0], ready[0].__name__)
    if len(ready) > 1:
        names = ", ".join(cls.__name__ for cls in ready)
        raise LoadError(f"{path} defines several nn.Module classes ({names}): name one with {path}:NAME")
    raise NoModelFound(_no_model_message(path))


def _file_inputs(module: ModuleType) -> ExampleInputs | None:
    for name in INPUT_FUNCTIONS:
        value = getattr(module, name, None)
        if value is None:
            continue
        if callable(value):
            return ExampleInputs.coerce(_call(value, f"{name}()"), f"{name}()")
        return ExampleInputs.coerce(value, name)
    return None
