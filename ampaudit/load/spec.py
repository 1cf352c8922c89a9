"""What the user points ampaudit at, and reading the file - no torch needed, so the lint can use it.

``PATH`` (a model file), ``PATH:NAME`` (a name the file defines), ``PATH:EXPR`` (a Python
expression evaluated in the file's namespace after import: ``model.py:"GPT(GPTConfig(n_layer=2))"``),
``module.path:NAME_OR_EXPR`` (an installed package: ``torch.nn:"Linear(4, 4)"``) and
``hf:MODEL_TYPE`` (a small transformers model built from its config class, no download).
A NAME is a Python identifier; anything else after the colon is an expression.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from ampaudit.core.errors import LoadError, UsageError
from ampaudit.core.paths import missing
from ampaudit.core.python_source import read_python

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
HF_PREFIX = "hf:"


@dataclass(frozen=True)
class ModelSpec:
    """One parsed target: a file, an installed module, or a transformers model type."""

    text: str  # as the user wrote it
    kind: str  # "file" | "module" | "hf"
    path: Path | None = None  # kind "file"
    module: str | None = None  # kind "module"; for "hf", the model type
    name: str | None = None  # an identifier after the colon
    expr: str | None = None  # an expression after the colon

    @property
    def selector(self) -> str | None:
        """What the user named after the colon (NAME or EXPR), None for a bare PATH."""
        return self.name if self.name is not None else self.expr


def _selector(text: str, spec: str) -> tuple[str | None, str | None]:
    text = text.strip()
    if NAME_RE.match(text):
        return text, None
    try:
        ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise UsageError(f"{spec}: {text!r} is neither a name nor a Python expression ({exc.msg})") from None
    except (RecursionError, MemoryError):  # nested past the parser's stack (MemoryError in CPython 3.11)
        raise UsageError("the expression after the colon is nested too deeply to parse") from None
    return None, text


def parse_spec(spec: str) -> ModelSpec:
    """``model.py:Net`` -> a file and a NAME; ``torch.nn:"Linear(4, 4)"`` -> a module and an EXPR."""
    if spec.startswith(HF_PREFIX) and not Path(spec).exists():
        model_type = spec[len(HF_PREFIX):].strip()
        if not re.match(r"^[A-Za-z0-9_-]+$", model_type):
            raise UsageError(f"{spec}: expected hf:MODEL_TYPE, such as hf:gpt2, hf:llama, hf:bert or hf:t5")
        return ModelSpec(spec, "hf", module=model_type)
    if spec.endswith(".py") or Path(spec).exists():
        return ModelSpec(spec, "file", Path(spec))
    head, sep, tail = spec.partition(".py:")
    if sep and head:
        name, expr = _selector(tail, spec)
        return ModelSpec(spec, "file", Path(head + ".py"), name=name, expr=expr)
    path_text, sep, tail = spec.rpartition(":")
    if sep and path_text and tail and Path(path_text).is_file():  # a model file not named .py
        name, expr = _selector(tail, spec)
        return ModelSpec(spec, "file", Path(path_text), name=name, expr=expr)
    module, sep, tail = spec.partition(":")
    if sep and tail.strip() and MODULE_RE.match(module):
        name, expr = _selector(tail, spec)
        return ModelSpec(spec, "module", module=module, name=name, expr=expr)
    return ModelSpec(spec, "file", Path(spec))


def parse_target(spec: str) -> tuple[Path, str | None]:
    """``model.py:Net`` -> (Path("model.py"), "Net"); a bare path -> (path, None). For a file
    target only: the path and what follows the colon."""
    parsed = parse_spec(spec)
    return (parsed.path if parsed.path is not None else Path(spec)), parsed.selector


def read_source(path: Path) -> str:
    if not path.exists():
        raise LoadError(missing(path, "file"))
    if path.is_dir():
        raise LoadError(f"{path} is a directory: give a Python file that defines the model")
    return read_python(path)[0]  # a coding cookie or a BOM, as Python reads the file
