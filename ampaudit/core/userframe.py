"""Find the user's source line behind an op: the innermost frame that is not torch's.

Tracers stamp every node with ``(file, line)`` from here, load-time errors point at the
user's line, and watch's replays name the line of the op that went non-finite. Walking a few
frames per node is far cheaper than fx's ``record_stack_traces`` (which formats the whole
stack). Like the rest of core/, importing this module does not import torch: torch's folder is
found from its import spec.
"""

from __future__ import annotations

import importlib.util
import os
import site
import sysconfig
import types
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypeVar


def _folder(path: str) -> str:
    return str(Path(path).resolve()) + os.sep


def _torch_roots() -> tuple[str, ...]:
    # find_spec returns an imported torch's own spec, so this is the torch that runs
    spec = importlib.util.find_spec("torch")
    return (_folder(os.path.dirname(spec.origin)),) if spec is not None and spec.origin else ()


_TORCH_ROOTS = _torch_roots()
_STDLIB_ROOT = _folder(sysconfig.get_paths()["stdlib"])
# Installed packages often live under the stdlib folder (lib/python3.X/site-packages), but
# they are model code as far as the user is concerned: transformers' modeling files, timm.
_PACKAGE_ROOTS = tuple({
    _folder(p) for p in (*site.getsitepackages(), site.getusersitepackages(),
                         sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])
})
_AMPAUDIT_ROOT = str(Path(__file__).resolve().parent.parent) + os.sep  # the ampaudit package
_verdicts: dict[str, str] = {}  # filename -> "user" | "internal" | "ampaudit"
_BOUNDARIES: set[types.CodeType] = set()

F = TypeVar("F", bound=Callable)


class Loc(NamedTuple):
    """A place in the user's source; ``column`` is 1-based, None where Python cannot tell."""

    file: str
    line: int
    column: int | None = None


_positions: dict[types.CodeType, list] = {}


def _column(code: types.CodeType, lasti: int) -> int | None:
    # Python 3.11+ keeps per-instruction source positions: the column of the very call.
    if not hasattr(code, "co_positions"):
        return None
    positions = _positions.get(code)
    if positions is None:
        positions = _positions[code] = list(code.co_positions())
    index = lasti // 2
    if 0 <= index < len(positions) and positions[index][2] is not None:
        return positions[index][2] + 1
    return None


def boundary(fn: F) -> F:
    """Mark an ampaudit entry point: frame walks stop there, since what lies beyond it is
    the code that called ampaudit (a test, a script calling ``ampaudit.check``), not the model."""
    _BOUNDARIES.add(fn.__code__)
    return fn


def classify(filename: str) -> str:
    """Whose code ``filename`` is: "user", "internal" (torch, the standard library) or "ampaudit"."""
    verdict = _verdicts.get(filename)
    if verdict is None:
        if filename.startswith("<"):  # <frozen ...>, <string>, fx-generated code
            verdict = "internal"
        else:
            path = os.path.realpath(filename)
            if path.startswith(_AMPAUDIT_ROOT):
                verdict = "ampaudit"
            elif path.startswith(_TORCH_ROOTS) or (
                path.startswith(_STDLIB_ROOT) and not path.startswith(_PACKAGE_ROOTS)
            ):
                verdict = "internal"
            else:
                verdict = "user"
        _verdicts[filename] = verdict
    return verdict


def user_location(frame: types.FrameType | None) -> Loc | None:
    """``(file, line)`` of the innermost user frame at or above ``frame``, or None.

    Torch's and ampaudit's own frames are skipped; the walk ends at a :func:`boundary`.
    """
    while frame is not None:
        code = frame.f_code
        if code in _BOUNDARIES:
            return None
        if classify(code.co_filename) == "user":
            return Loc(code.co_filename, frame.f_lineno, _column(code, frame.f_lasti))
        frame = frame.f_back
    return None


def traceback_location(tb: types.TracebackType | None) -> Loc | None:
    """The innermost user frame of an exception's traceback (where the user's code failed)."""
    found = None
    while tb is not None:
        if classify(tb.tb_frame.f_code.co_filename) == "user":
            code = tb.tb_frame.f_code
            found = Loc(code.co_filename, tb.tb_lineno, _column(code, tb.tb_lasti))
        tb = tb.tb_next
    return found
