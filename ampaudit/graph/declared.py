"""Precision a model declares for itself, read off the model object.

transformers' ``PreTrainedModel`` carries two such declarations:

- ``_keep_in_fp32_modules``: module names kept in fp32 when the model is loaded in
  float16 (T5 keeps its feed-forward output ``wo`` there: its activations overflow fp16);
  ``_keep_in_fp32_modules_strict``: kept in fp32 under float16 and bfloat16. Names match
  module or parameter paths at dot boundaries (``wo``, ``gate.weight``), ``*`` as a glob.
- ``config.dtype`` (``config.torch_dtype`` before transformers 4.56): the dtype the weights
  were trained and saved in.

Any ``nn.Module`` with the same attributes declares the same things. The graph passes read
the fp32 modules (their ops compute in fp32 when the model is cast down); check's rules
read the trained dtype.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampaudit.core.dtypes import LowDtype
from ampaudit.core.userframe import Loc
from ampaudit.graph.fx_tracer import forward_location

# attribute -> the low dtypes it applies to (transformers' PreTrainedModel._get_dtype_plan)
_FP32_ATTRIBUTES = {
    "_keep_in_fp32_modules": ("float16",),
    "_keep_in_fp32_modules_strict": ("float16", "bfloat16"),
}


@dataclass(frozen=True)
class Fp32Module:
    """A module the model keeps in fp32, and the declaration that says so."""

    path: str  # qualified module path ("encoder.block.0.layer.1.DenseReluDense.wo")
    attribute: str  # "_keep_in_fp32_modules"
    pattern: str  # the name in it that matched ("wo")


@dataclass(frozen=True)
class Declared:
    owner: str = ""  # the model's class name
    fp32: tuple[Fp32Module, ...] = ()  # outermost modules only
    trained_dtype: str | None = None  # "bfloat16", "float16", "float32" - from the config
    loc: Loc | None = None  # the model's class definition

    def fp32_module(self, path: str | None) -> Fp32Module | None:
        """The declared module that ``path`` is, or is inside of."""
        if path is None:
            return None
        for module in self.fp32:
            if path == module.path or path.startswith(module.path + "."):
                return module
        return None

    @property
    def patterns(self) -> list[str]:
        return list(dict.fromkeys(m.pattern for m in self.fp32))


@dataclass
class _Matcher:
    attribute: str
    patterns: list[str]
    regex: re.Pattern[str] = field(init=False)

    def __post_init__(self) -> None:
        body = "|".join(f"(?:{re.escape(p).replace(re.escape('*'), '.*')})" for p in self.patterns)
        self.regex = re.compile(rf"(?:^|\.)(?P<name>{body})(?:$|\.)")

    def match(self, name: str) -> str | None:
        """The pattern ``name`` matches at dot boundaries, or None."""
        hit = self.regex.search(name)
        if hit is None:
            return None
        text = hit.group("name")
        return next((p for p in self.patterns if re.fullmatch(re.escape(p).replace(re.escape("*"), ".*"), text)),
                    text)


def _names(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, Iterable):
        return sorted(str(v) for v in value if v)
    return []


def _dtype_name(value: Any) -> str | None:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, str) and value and value != "auto":
        return value.removeprefix("torch.")
    return None


def trained_dtype(model: torch.nn.Module) -> str | None:
    """``config.dtype`` or ``config.torch_dtype``, read without property side effects."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    fields = config if isinstance(config, dict) else getattr(config, "__dict__", {})
    for key in ("dtype", "torch_dtype"):
        name = _dtype_name(fields.get(key))
        if name is not None:
            return name
    return None


def _class_location(model: torch.nn.Module) -> Loc:
    try:
        file = inspect.getsourcefile(type(model))
        _, line = inspect.getsourcelines(type(model))
    except (OSError, TypeError):
        return forward_location(model)
    return Loc(file, line) if file else forward_location(model)


def declared_precision(model: torch.nn.Module, dtype: LowDtype) -> Declared:
    """What ``model`` declares, for an audit in ``dtype``."""
    matchers = []
    for attribute, dtypes in _FP32_ATTRIBUTES.items():
        patterns = _names(getattr(model, attribute, None))
        if patterns and dtype.name in dtypes:
            matchers.append(_Matcher(attribute, patterns))
    fp32: list[Fp32Module] = []
    if matchers:
        for path, module in model.named_modules():
            if not path or any(path.startswith(m.path + ".") for m in fp32):
                continue
            hit = _declares(path, module, matchers)
            if hit is not None:
                fp32.append(Fp32Module(path, *hit))
    return Declared(type(model).__name__, tuple(fp32), trained_dtype(model), _class_location(model))


def _declares(path: str, module: torch.nn.Module, matchers: list[_Matcher]) -> tuple[str, str] | None:
    """(attribute, pattern) when the module's path matches, or every parameter of its own does
    (``gate.weight`` keeps the whole ``gate`` linear in fp32)."""
    own = [name for name, _ in module.named_parameters(recurse=False)]
    for matcher in matchers:
        pattern = matcher.match(path)
        if pattern is not None:
            return matcher.attribute, pattern
        hits = [matcher.match(f"{path}.{name}") for name in own]
        if own and all(hits):
            return matcher.attribute, hits[0]
    return None
