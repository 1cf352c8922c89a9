from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from ampaudit.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "fixtures" / "models"
RULE_FIXTURES = ROOT / "fixtures" / "rules"


def pytest_addoption(parser):
    # tests/test_rule_goldens.py: accept what the rules give now (AMPAUDIT_UPDATE_GOLDENS=1 does the same)
    parser.addoption("--update-goldens", action="store_true",
                     help="rewrite the rule golden files (*.expected, *.fixed.py) instead of comparing with them")


def pytest_configure(config):
    # A fresh build cache per run: the suite compiles watch's C kernel itself (about 0.1 s)
    # rather than trusting whatever an earlier version left in ~/.cache.
    os.environ["AMPAUDIT_CACHE_DIR"] = config._ampaudit_cache = tempfile.mkdtemp(prefix="ampaudit-cache-")
    # One torch thread (here and in the subprocesses tests start): the tensors are tiny, and
    # OpenMP threads that spin while another worker or process holds the core make a step up
    # to 40x slower (measured: one convert test, 2.5 s alone, took 110 s on a loaded machine).
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:  # a plugin imported it before the variable could count
        sys.modules["torch"].set_num_threads(1)
    _load_hypothesis_profile()


def _load_hypothesis_profile() -> None:
    # "quick" for a developer's run, "ci" in CI (.ci/run): tests/test_fuzz.py scales each test's
    # example count by max_examples / 100, so "ci" runs the counts the tests name.
    try:
        from hypothesis import settings
    except ImportError:
        return
    settings.register_profile("ci", max_examples=100)
    settings.register_profile("quick", max_examples=10)
    settings.load_profile(os.environ.get("AMPAUDIT_HYPOTHESIS_PROFILE", "quick"))


def pytest_collection_modifyitems(config, items):
    # The slow tier (benchmarks, wheel installs, real-compiler runs) runs only when a -m
    # expression asks for it: `python -m pytest -m slow`, as .ci/run does after the default run.
    if config.option.markexpr:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


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
    # Reports name files relative to the working directory; pin it so paths are stable. The
    # width of a report is rich's choice from COLUMNS (a terminal, pytest-xdist's workers set
    # it to 80): tests that want a width set it themselves.
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)


class CliResult:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def json(self):
        return json.loads(self.out)


@pytest.fixture(autouse=True)
def _model_code_in_this_process(request, monkeypatch):
    """The command line runs the model's code in a child process (core/child.py), which imports
    torch afresh: about 2 s a test. Here it runs in this process, still through pickle both
    ways, so that what crosses the boundary is checked; tests marked ``child_process`` (which
    test the boundary itself, and ``--import-timeout``) start the real child."""
    if request.node.get_closest_marker("child_process") is None:
        import ampaudit.core.child as child

        monkeypatch.setattr(child, "run_in_child", _run_here)


def _run_here(module: str, function: str, *args, import_timeout=None, **kwargs):
    import importlib
    import pickle

    from ampaudit.core.errors import AmpauditError

    args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))
    try:
        value = getattr(importlib.import_module(module), function)(*args, **kwargs)
    except AmpauditError as exc:
        raise pickle.loads(pickle.dumps(exc)) from exc
    return pickle.loads(pickle.dumps(value))


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


def host_syncs(fn) -> int:
    """How many times ``fn`` (then a final synchronize) made the host wait on the GPU, as
    torch's sync debug mode counts them."""
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


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
