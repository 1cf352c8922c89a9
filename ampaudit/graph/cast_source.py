"""Whether a recorded cast's dtype is written in the code or follows a tensor, from the source.

A recording bakes ``w.to(x.dtype)`` into a cast to one dtype. The float64 recording
(``recorder``) tells the two apart where the model's values stay float64, but a model that
casts its inputs to fp32 first - EDM2's ``Precond`` (``x = x.to(torch.float32)``), most
diffusion wrappers - makes every later ``x.dtype`` fp32 again, and ``w.to(x.dtype)`` (EDM2's
``MPConv``: the weight normalised in fp32, then cast to the activations' dtype) read as the
user asking for fp32: every conv and matmul after it stayed fp32. The call's own source says
which it is: ``torch.float32`` (or ``torch.float``, ``"float32"``) is written out, ``x.dtype``
or a name is not.
"""

from __future__ import annotations

import ast
import os
from functools import lru_cache

import torch

_CASTS = ("to", "type")
_DTYPE_NAMES = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))


@lru_cache(maxsize=64)
def _calls(file: str, mtime: float) -> dict[tuple[int, int], list[ast.Call]]:
    """The file's ``.to(...)``/``.type(...)`` calls by (line, column) of their start."""
    try:
        with open(file, encoding="utf-8") as f:
            tree = ast.parse(f.read(), file)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError, RecursionError, MemoryError):  # unknown: no answer
        return {}
    found: dict[tuple[int, int], list[ast.Call]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _CASTS:
            found.setdefault((node.lineno, node.col_offset + 1), []).append(node)
    return found


def _written(expr: ast.expr) -> bool | None:
    """True for a dtype spelled out (``torch.float32``, ``"float32"``), False for one read from
    something (``x.dtype``, a name), None for an argument that is no dtype at all."""
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "torch":
        return True if expr.attr in _DTYPE_NAMES else None  # torch.device(...) and the like: no dtype
    if isinstance(expr, ast.Constant):
        return True if isinstance(expr.value, str) else None  # "float32"; a number is no dtype
    if isinstance(expr, (ast.Name, ast.Attribute, ast.Subscript, ast.Call)):
        return False
    return None


def dtype_written(file: str, line: int, column: int | None) -> bool | None:
    """Whether the cast called at ``file:line:column`` spells its dtype out (True), reads it
    from a value (False), or cannot be told (None: no source, several calls there that
    disagree, no dtype argument)."""
    if column is None:
        return None
    try:
        calls = _calls(file, os.path.getmtime(file)).get((line, column), [])
    except OSError:
        return None
    verdicts = set()
    for call in calls:
        # x.to(device, torch.float32): the dtype spelled out decides; x.to(y.device, y.dtype): read
        seen = {_written(a) for a in [*call.args, *(k.value for k in call.keywords if k.arg == "dtype")]}
        if True in seen or False in seen:
            verdicts.add(True in seen)
    return verdicts.pop() if len(verdicts) == 1 else None
