"""A script's uncaught exception under ``ampaudit run`` (and ``--probe-loss``) is printed exactly
as python prints it: no frame of watch's wrappers (``torch.autograd.backward``'s, a
GradScaler's) nor of the loss probe's call made as from the user's line (``watch/own_frames.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PRELUDE = """
import torch, warnings
import torch.nn.functional as F
m = torch.nn.Linear(4, 4)
out = m(torch.ones(2, 4))
"""

ENDINGS = {
    # a second backward through freed buffers: the error rises through torch.autograd.backward
    "backward": "loss = out.sum()\nloss.backward()\nloss.backward()\n",
    # a C++ function's error, in the loss code (the probe's mode calls it)
    "c-function": "out @ torch.ones(3, 3)\n",
    # a Python function's warning made an error: torch's overrides frames ran under the probe
    "python-function": "warnings.simplefilter('error')\nF.softmax(\n    out)\n",
    # raised inside a function of the script, through a lambda
    "nested": "def f(t):\n    return (lambda: torch.cat([t, torch.ones(2, 3)]))()\nf(out)\n",
}


@pytest.mark.parametrize("probe", [(), ("--probe-loss",)], ids=["run", "probe-loss"])
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_an_uncaught_error_s_traceback_is_python_s(tmp_path, ending, probe):
    (tmp_path / "s.py").write_text(PRELUDE + ENDINGS[ending])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plain = subprocess.run([sys.executable, "s.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 1 and plain.stderr.startswith("Traceback (most recent call last):\n")
    watched = subprocess.run([sys.executable, "-m", "ampaudit", "run", "--log", "w.jsonl", *probe, "s.py"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert watched.returncode == 1
    assert watched.stderr.split("╭─ ampaudit watch", 1)[0] == plain.stderr
