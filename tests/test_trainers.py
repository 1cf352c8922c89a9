"""Trainer shapes real projects use (fixtures/trainers): the lint reports exactly the planted
bugs (`# expect: CODE` lines) and nothing else; `--fix --unsafe-fixes` removes the fixable ones
and leaves a script that still runs on the CPU with AMP on and with AMP off.

Each shape NN has a ``NN_<shape>_clean.py`` (no finding at all, apart from an expected AMP402
on an apex import) and a ``NN_<shape>_bug.py`` (one or two planted bugs). A fixture whose module
docstring has a line ``runnable: no`` needs a package the tests do not install (accelerate,
lightning, apex) or cannot run once fixed; every other one is a real training script: it reads
``USE_AMP=1`` / ``USE_AMP=0`` and trains a tiny model on random data in about a second.

Scripts run as ``python script.py`` would run them (``__main__``, argv, cwd, ``sys.path[0]``),
each in its own process with a 60 s limit; to keep the file fast, the processes are forked from
one server that has imported torch once (a plain ``subprocess`` per run where fork is missing).
"""

from __future__ import annotations

import ast
import collections
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ampaudit.check.lint_file import lint_source
from tests.conftest import ROOT, expected_markers

TRAINERS = ROOT / "fixtures" / "trainers"
FIXTURES = sorted(TRAINERS.glob("[0-9][0-9]_*.py"))
SHAPES = range(1, 14)
RUN_TIMEOUT_S = 60
# The scripts are tiny: one intra-op thread each keeps them fast and steady on a busy 2-core machine.
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# Codes whose findings carry an automatic fix (docs/check.md, "Fixes"): AMP401 with --fix,
# the others with --unsafe-fixes. Planted findings of other codes have no fix and may stay.
FIXABLE = frozenset({"AMP401", "AMP405", "AMP406", "AMP407", "AMP414"})

# Text a finding's message must contain: the right scaler paired with the right optimizer,
# and a variable autocast dtype that can be float16 said so.
MESSAGE_NAMES = {
    ("13_gan_two_scalers_bug.py", "AMP405"): ("d_scaler.step(d_opt)",),
    ("13_gan_two_scalers_bug.py", "AMP406"): ("g_scaler.unscale_(g_opt)",),
    ("08_nanogpt_noscaler_bug.py", "AMP403"): ("dtype",),
}

# After --fix --unsafe-fixes: text the fixed file must contain, and text it must not.
FIX_MUST_CONTAIN = {
    "11_version_gate_bug.py": ("        scaler = torch.cuda.amp.GradScaler(enabled=use_amp)\n",),  # the gated fallback
    "13_gan_two_scalers_bug.py": ("d_scaler.step(d_opt)", "g_scaler.unscale_(g_opt)"),
}
FIX_MUST_NOT_CONTAIN = {
    "13_gan_two_scalers_bug.py": ("g_scaler.step(d_opt)", "d_scaler.step(g_opt)", "d_scaler.unscale_(g_opt)",
                                  "g_scaler.unscale_(d_opt)", "d_scaler.unscale_(optimizer)"),
}


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def _runnable(path: Path) -> bool:
    return re.search(r"^runnable: no\b", _docstring(path), re.MULTILINE) is None


CLEAN = [p for p in FIXTURES if p.stem.endswith("_clean")]
BUGGY = [p for p in FIXTURES if p.stem.endswith("_bug")]
RUNNABLE_CLEAN = [p for p in CLEAN if _runnable(p)]
RUNNABLE_BUGGY = [p for p in BUGGY if _runnable(p)]
MODES = [pytest.param("1", id="amp_on"), pytest.param("0", id="amp_off")]


def _ids(paths):
    return [p.name for p in paths]


def _describe(finding) -> str:
    return f"{finding.rule} line {finding.line} [{finding.severity.value}]: {finding.message}"


def _marker_mismatch(path: Path, findings) -> str:
    expected = collections.Counter(expected_markers(path))
    got = collections.Counter((f.line, f.rule) for f in findings)
    lines = path.read_text().splitlines()
    out = []
    for f in sorted(findings, key=lambda f: (f.line, f.rule)):
        if got[(f.line, f.rule)] > expected[(f.line, f.rule)]:
            out.append(f"  unexpected {_describe(f)}\n      {lines[f.line - 1].strip()}")
    for (line, code), count in sorted((expected - got).items()):
        out.append(f"  missing    {code} line {line} (x{count})\n      {lines[line - 1].strip()}")
    return "\n".join(out)


# --------------------------------------------------------------------------- the fixture set


def test_every_shape_has_a_clean_and_a_buggy_fixture():
    for shape in SHAPES:
        prefix = f"{shape:02d}_"
        assert any(p.name.startswith(prefix) for p in CLEAN), f"no clean fixture for shape {shape}"
        assert any(p.name.startswith(prefix) for p in BUGGY), f"no buggy fixture for shape {shape}"
    assert {p.name[:2] for p in FIXTURES} == {f"{s:02d}" for s in SHAPES}


@pytest.mark.parametrize("path", BUGGY, ids=_ids(BUGGY))
def test_buggy_fixtures_plant_one_or_two_bugs(path):
    planted = [code for _, code in expected_markers(path) if code != "AMP402"]
    assert 1 <= len(planted) <= 2, planted
    assert "Planted bug" in _docstring(path)


@pytest.mark.parametrize("path", CLEAN, ids=_ids(CLEAN))
def test_clean_fixtures_plant_nothing(path):
    # apex is deprecated whatever the code does with it: its import is the only finding allowed.
    assert {code for _, code in expected_markers(path)} <= {"AMP402"}


@pytest.mark.parametrize("path", RUNNABLE_CLEAN + RUNNABLE_BUGGY, ids=_ids(RUNNABLE_CLEAN + RUNNABLE_BUGGY))
def test_runnable_fixtures_are_scripts_with_an_amp_switch(path):
    text = path.read_text()
    assert 'if __name__ == "__main__":' in text
    assert 'os.environ.get("USE_AMP", "1") == "1"' in text


# --------------------------------------------------------------------------- lint


# Planted bugs the lint does not see yet go here, with the reason; strict: when the lint
# learns one, its test flips to XPASS and fails until the entry is removed.
NOT_YET: dict[str, str] = {}  # fixture name -> why the lint cannot see its planted bug yet


def _known_gap(path: Path):
    reason = NOT_YET.get(path.name)
    return pytest.param(path, id=path.name, marks=pytest.mark.xfail(strict=True, reason=reason)) if reason else \
        pytest.param(path, id=path.name)


@pytest.mark.parametrize("path", [_known_gap(p) for p in FIXTURES])
def test_lint_reports_exactly_the_expected_lines(path):
    findings = lint_source(str(path), path.read_text())
    got = sorted((f.line, f.rule) for f in findings)
    assert got == sorted(expected_markers(path)), f"{path.name}:\n{_marker_mismatch(path, findings)}"


@pytest.mark.parametrize(("name", "code"), sorted(MESSAGE_NAMES), ids=[f"{n}-{c}" for n, c in sorted(MESSAGE_NAMES)])
def test_findings_name_the_right_scaler_optimizer_and_dtype(name, code):
    path = TRAINERS / name
    findings = [f for f in lint_source(str(path), path.read_text()) if f.rule == code]
    assert findings, f"no {code} in {name}"
    for finding in findings:
        for needle in MESSAGE_NAMES[(name, code)]:
            assert needle in finding.message, _describe(finding)


# --------------------------------------------------------------------------- running the scripts

_SERVER = textwrap.dedent(r'''
    import atexit, json, logging, os, runpy, signal, sys, time, traceback
    import torch  # imported once: every run forks from here
    import torch._dynamo  # what the first optimizer would otherwise import, in every run (about 2 s)
    import torch.nn.functional, torch.optim, torch.amp, torch.utils.data

    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else the server prints goes to stderr, never into the protocol
    protocol.write("ready\n")
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the script's own process
            code = 0
            try:
                log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                os.environ.update(request["env"])
                os.chdir(request["cwd"])
                sys.argv = [request["script"]]
                sys.path.insert(0, os.path.dirname(request["script"]))
                runpy.run_path(request["script"], run_name="__main__")
            except SystemExit as exc:
                if exc.code is None or isinstance(exc.code, int):
                    code = exc.code or 0
                else:
                    print(exc.code, file=sys.stderr)
                    code = 1
            except BaseException:
                traceback.print_exc()
                code = 1
            try:
                atexit._run_exitfuncs()
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
        deadline = time.monotonic() + request["timeout"]
        status = None
        while True:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status = raw
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.005)
        rc = os.waitstatus_to_exitcode(status) if status is not None else None
        protocol.write(json.dumps({"rc": rc, "timed_out": status is None}) + "\n")
''')


class ScriptRunner:
    """Runs a script as `USE_AMP=... python script.py`, in a fresh process, with a time limit."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.count = 0
        self.server = None
        if hasattr(os, "fork"):
            self.server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True, bufsize=1, cwd=workdir,
                                           env={**os.environ, **THREADS})
            assert self.server.stdout.readline() == "ready\n", "the fork server did not start"

    def run(self, script: Path, use_amp: str) -> tuple[int | None, str]:
        self.count += 1
        log = self.workdir / f"run{self.count}.log"
        env = {"USE_AMP": use_amp, "PYTHONWARNINGS": "default", **THREADS}
        if self.server is None:
            try:
                done = subprocess.run([sys.executable, str(script)], cwd=script.parent, env={**os.environ, **env},
                                      capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                return None, f"timed out after {RUN_TIMEOUT_S} s"
            return done.returncode, done.stdout + done.stderr
        request = {"script": str(script), "env": env, "cwd": str(script.parent), "log": str(log),
                   "timeout": RUN_TIMEOUT_S}
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        reply = self.server.stdout.readline()
        assert reply, "the fork server died"
        result = json.loads(reply)
        output = log.read_text(errors="replace") if log.exists() else ""
        if result["timed_out"]:
            output += f"\n[timed out after {RUN_TIMEOUT_S} s]"
        return result["rc"], output

    def close(self) -> None:
        if self.server is not None:
            self.server.stdin.close()
            self.server.wait(timeout=30)


@pytest.fixture(scope="session")
def runner(tmp_path_factory):
    r = ScriptRunner(tmp_path_factory.mktemp("trainer-runs"))
    yield r
    r.close()


def _assert_runs(runner, script: Path, use_amp: str, what: str) -> None:
    rc, output = runner.run(script, use_amp)
    assert rc == 0, f"{what} exited {rc} with USE_AMP={use_amp}:\n{output[-3000:]}"


@pytest.mark.parametrize("use_amp", MODES)
@pytest.mark.parametrize("path", RUNNABLE_CLEAN, ids=_ids(RUNNABLE_CLEAN))
def test_clean_fixture_runs(runner, path, use_amp):
    _assert_runs(runner, path, use_amp, path.name)


# --------------------------------------------------------------------------- --fix --unsafe-fixes


_FIXED: dict[str, str] = {}  # fixture name -> its text after the fix, computed once per session


def _fix(cli, tmp_path: Path, path: Path) -> Path:
    """A copy of the fixture after `ampaudit check COPY --fix --unsafe-fixes`."""
    target = tmp_path / path.name
    if path.name in _FIXED:
        target.write_text(_FIXED[path.name])
        return target
    shutil.copy(path, target)
    result = cli("check", target, "--fix", "--unsafe-fixes", "--fail-on", "never")
    assert result.code == 0, f"ampaudit check --fix exited {result.code}:\n{result.err}"
    _FIXED[path.name] = target.read_text()
    return target


def _edits_away_from(before: str, after: str, lines: set[int]) -> list[int]:
    """Original lines (1-based) the fix replaced or deleted, or inserted next to, that are not
    in ``lines``: a fix belongs on the line of its finding (an insertion right before or after)."""
    stray = []
    matcher = difflib.SequenceMatcher(None, before.splitlines(), after.splitlines(), autojunk=False)
    for tag, i1, i2, _, _ in matcher.get_opcodes():
        if tag in ("replace", "delete"):
            stray += [n for n in range(i1 + 1, i2 + 1) if n not in lines]
        elif tag == "insert" and not {i1, i1 + 1} & lines:  # between original lines i1 and i1 + 1
            stray.append(i1 + 1)
    return stray


def _diff(before: str, after: str, name: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), name, f"{name} (fixed)"))


@pytest.mark.parametrize("path", RUNNABLE_BUGGY, ids=_ids(RUNNABLE_BUGGY))
def test_unsafe_fixes_remove_the_planted_findings(cli, tmp_path, path):
    fixed = _fix(cli, tmp_path, path)
    before, after = path.read_text(), fixed.read_text()
    compile(after, str(fixed), "exec")
    planted = [code for _, code in expected_markers(path)]
    problems = []
    if any(code in FIXABLE for code in planted) and after == before:
        problems.append("nothing was fixed")
    may_stay = collections.Counter(code for code in planted if code not in FIXABLE)
    remaining = lint_source(str(fixed), after)
    left = collections.Counter(f.rule for f in remaining) - may_stay
    problems += [f"still (or newly) reported: {_describe(f)}" for f in remaining if f.rule in left]
    stray = _edits_away_from(before, after, {line for line, _ in expected_markers(path)})
    if stray:
        problems.append(f"the fix changed code that has no planted finding: original lines {stray}")
    problems += [f"{needle!r} missing after the fix" for needle in FIX_MUST_CONTAIN.get(path.name, ())
                 if needle not in after]
    problems += [f"the fix wrote {needle!r}" for needle in FIX_MUST_NOT_CONTAIN.get(path.name, ()) if needle in after]
    assert not problems, (f"{path.name} (planted: {planted}):\n  " + "\n  ".join(problems)
                          + f"\n{_diff(before, after, path.name)}")


@pytest.mark.parametrize("path", CLEAN, ids=_ids(CLEAN))
def test_unsafe_fixes_leave_clean_fixtures_alone(cli, tmp_path, path):
    # --lint-only: the fixtures that need accelerate, lightning or apex cannot be imported here.
    target = tmp_path / path.name
    shutil.copy(path, target)
    result = cli("check", target, "--lint-only", "--fix", "--unsafe-fixes", "--fail-on", "never")
    assert result.code == 0, result.err
    assert target.read_text() == path.read_text(), _diff(path.read_text(), target.read_text(), path.name)


@pytest.mark.parametrize("use_amp", MODES)
@pytest.mark.parametrize("path", RUNNABLE_BUGGY, ids=_ids(RUNNABLE_BUGGY))
def test_fixed_buggy_fixture_runs(cli, runner, tmp_path, path, use_amp):
    fixed = _fix(cli, tmp_path, path)
    diff = _diff(path.read_text(), fixed.read_text(), path.name)
    _assert_runs(runner, fixed, use_amp, f"{path.name} after --fix --unsafe-fixes\n{diff}\n")
