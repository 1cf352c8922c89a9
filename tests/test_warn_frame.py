"""A torch function mode's call made from a function compiled as the caller's line
(``watch/warn_frame.py``): warnings land where they land without the mode, and a traceback
through it marks the user's own call."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ampaudit.watch.warn_frame import call_for

THIS = os.path.abspath(__file__)


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return call_for(func, args, kwargs)


def _code(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    copied = torch.tensor(a)  # C++ warns
    total = copied.sum() + torch.nn.functional.softmax(a).sum()  # Python warns, stacklevel
    return total + torch.matmul(a, b).mean()  # raises for 2x3 @ 2x3


def _run(mode: bool) -> tuple[list[tuple[str, int, str]], list[tuple[str, int | None, int | None, int | None]]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with _Mode() if mode else contextlib.nullcontext():
                _code(torch.ones(2, 3), torch.ones(2, 3))
        except RuntimeError as error:
            frames = [(f.name, f.lineno, f.colno, f.end_colno) for f in traceback.extract_tb(error.__traceback__)
                      if f.filename == THIS and f.name == "_code"]
    return [(w.filename, w.lineno, str(w.message)[:20]) for w in caught], frames


@pytest.mark.skipif(sys.version_info < (3, 11), reason="columns in tracebacks: Python 3.11+")
def test_warnings_and_the_traceback_name_the_user_s_line_and_call():
    plain_warnings, plain_frames = _run(False)
    moded_warnings, moded_frames = _run(True)
    assert [(f, n) for f, n, _ in plain_warnings] == [(THIS, 28), (THIS, 29)]
    assert moded_warnings == plain_warnings
    call = plain_frames[-1]
    assert call == ("_code", 30, 19, 37)  # torch.matmul(a, b)
    assert moded_frames == [call, call]  # the user's frame, and the call made as from it


def test_a_torch_function_the_script_wrapped_runs_once_its_warning_at_the_wrapper_s_line(monkeypatch):
    """``F.softmax`` replaced by a ``functools.wraps`` wrapper (as a script patches
    ``torch.autograd.grad``; as backward_tap does): torch's softmax asks the mode with what its
    module's name holds now, the wrapper - called again by the mode, it ran twice."""
    import functools

    original = torch.nn.functional.softmax
    calls = []

    @functools.wraps(original)
    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)  # the wrapper's line: the warning's, without the mode

    monkeypatch.setattr(torch.nn.functional, "softmax", counted)
    seen = {}
    for mode in (False, True):
        calls.clear()
        with warnings.catch_warnings(record=True) as caught, _Mode() if mode else contextlib.nullcontext():
            warnings.simplefilter("always")
            torch.nn.functional.softmax(torch.ones(2, 3))
        seen[mode] = (len(calls), [(w.filename, w.lineno) for w in caught])
    with open(THIS) as f:
        wrapper_line = next(i for i, text in enumerate(f, 1) if "# the wrapper's line" in text)
    assert seen[False] == (1, [(THIS, wrapper_line)])
    assert seen[True] == seen[False]
