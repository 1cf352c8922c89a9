from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from ampaudit.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "fixtures" / "models"
RULE_FIXTURES = ROOT / "fixtures" / "rules"


def pytest_configure(config):
    # A fresh build cache per run: the suite compiles watch's C kernel itself (about 0.1 s)
    # rather than trusting whatever an earlier version left in ~/.cache.
    os.environ["AMPAUDIT_CACHE_DIR"] = config._ampaudit_cache = tempfile.mkdtemp(prefix="ampaudit-cache-")


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "_ampaudit_cache", ""), ignore_errors=True)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """ampaudit's wheel, built from this checkout offline (hatchling, no build isolation)."""
    import subprocess
    import sys

    pytest.importorskip("hatchling", reason="the dev extra installs hatchling to build wheels offline")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(out)], check=True, timeout=300)
    (path,) = out.glob("ampaudit-*.whl")
    return path


@pytest.fixture(autouse=True)
def _run_from_repo_root(monkeypatch):
    # Reports name files relative to the working directory; pin it so paths are stable.
    monkeypatch.chdir(ROOT)


class CliResult:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def json(self):
        return json.loads(self.out)


@pytest.fixture
def cli(capsys):
    """Run the ampaudit CLI in-process; returns exit code, stdout and stderr."""

    def run(*args: str) -> CliResult:
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


def model(name: str) -> str:
    return str((MODELS / name).relative_to(ROOT))


def line_of(path: Path | str, needle: str) -> int:
    """1-based line of the only line containing ``needle`` (fails if not exactly one)."""
    text = Path(ROOT / path).read_text().splitlines()
    hits = [i + 1 for i, line in enumerate(text) if needle in line]
    assert len(hits) == 1, f"{needle!r} found on lines {hits} of {path}"
    return hits[0]


def expected_markers(path: Path) -> list[tuple[int, str]]:
    """(line, code) for every `# expect: CODE` comment in a fixture."""
    out = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        for code in re.findall(r"#\s*expect:\s*(AMP\d{3})", line):
            out.append((number, code))
    return out
