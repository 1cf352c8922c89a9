"""bench/gpu_session.sh, the one prepared run of every GPU check for a session lent a GPU: it
must parse, and every test file and benchmark it runs must exist (a renamed file would cost
that session's few minutes of device time)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_session.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_gpu_session_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True).returncode == 0


def test_every_check_it_runs_exists_and_gets_a_limit():
    steps = re.findall(r"^step (\w+) (\d+) (.+)$", SCRIPT.read_text(), flags=re.M)
    assert [name for name, _, _ in steps] == ["watch_cuda", "fp8_cuda", "watch_gpu", "convert_speed"]
    for _, _, command in steps:
        paths = re.findall(r"(?:tests|bench)/\w+\.py", command)
        assert paths and all((ROOT / p).is_file() for p in paths), command
    # a machine's start takes a minute or two of the session's 15: the steps leave room for it
    assert sum(int(limit) for _, limit, _ in steps) <= 540
