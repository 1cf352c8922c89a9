"""``pip install ampaudit`` is the lint alone: the wheel, installed into a fresh venv without
torch, lints a folder; and the pre-commit hook installs and runs through ``pre-commit try-repo``.

Offline: the wheel is built from this checkout, its dependencies (rich and what rich needs;
hatchling, for the hook's build) are zipped back from what is installed here
(tests/wheelhouse.py), and pip runs with ``--no-index`` and no configuration. CI runs these
(``python -m pytest -q``); ``-m "not slow"`` skips them locally.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ampaudit.core.torch_extra import INSTALL
from tests.conftest import ROOT, RULE_FIXTURES, model

pytestmark = pytest.mark.slow
FOLDER = "fixtures/trainers"


def _offline_env(**extra: str) -> dict[str, str]:
    """pip offline and unconfigured; nothing of this checkout or this environment on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            **extra}


@pytest.fixture(scope="module")
def wheelhouse(wheel, tmp_path_factory) -> Path:
    """The built wheel and wheels of everything ``pip install ampaudit`` and its build need."""
    pytest.importorskip("packaging")
    from tests import wheelhouse

    out = tmp_path_factory.mktemp("wheelhouse")
    shutil.copy(wheel, out)
    try:
        wheelhouse.fill(out, [*wheelhouse.wheel_requires(wheel), "hatchling>=1.18"])
    except wheelhouse.Unavailable as exc:
        pytest.skip(f"no offline wheels of ampaudit's dependencies: {exc}")
    return out


def test_the_wheel_requires_no_torch_and_its_extra_does(wheel):
    from tests.wheelhouse import wheel_requires

    requires = wheel_requires(wheel)
    core = [r for r in requires if "extra ==" not in r]
    assert not [r for r in core if r.split(";")[0].strip().startswith(("torch", "safetensors"))], core
    extra = {name: [r.split(";")[0].replace(" ", "") for r in requires if f"extra == '{name}'" in
                    r.replace('"', "'")] for name in ("torch", "dev", "tensorboard", "plot")}
    assert {"torch>=2.4", "safetensors>=0.4"} <= set(extra["torch"])
    assert {"torch>=2.4", "safetensors>=0.4"} <= set(extra["dev"])  # README's set-up installs the dev extra
    assert "torch>=2.4" in extra["tensorboard"]  # torch.utils.tensorboard
    assert not [r for r in extra["plot"] if r.startswith("torch")]  # report --plot needs matplotlib alone


@pytest.fixture(scope="module")
def lint_venv(wheelhouse, tmp_path_factory) -> Path:
    """A fresh venv with ``pip install ampaudit`` (offline, from the wheelhouse): its bin folder."""
    venv = tmp_path_factory.mktemp("lint_venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                           "--find-links", str(wheelhouse), "ampaudit"], env=_offline_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return python.parent


def _venv_run(bin_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_dir / "ampaudit"), *args], cwd=ROOT, env=_offline_env(COLUMNS="100"),
                          capture_output=True, text=True, timeout=120)


def test_the_lint_only_install_lints_a_folder(lint_venv, cli):
    probe = subprocess.run([str(lint_venv / "python"), "-I", "-c",
                            "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('safetensors'))"],
                           capture_output=True, text=True, timeout=60, check=True)
    assert probe.stdout.split() == ["None", "None"]  # no torch, no safetensors in the venv
    installed = _venv_run(lint_venv, "check", "--format", "json", FOLDER)
    here = cli("check", "--format", "json", FOLDER)
    assert (installed.returncode, installed.stdout) == (here.code, here.out), installed.stderr
    assert len(json.loads(installed.stdout)["findings"]) >= 10


def test_the_lint_only_install_says_what_needs_torch(lint_venv):
    amp006 = _venv_run(lint_venv, "check", "--format", "json", model("clean_cnn.py"))
    assert amp006.returncode == 0, amp006.stderr
    assert [f["rule"] for f in json.loads(amp006.stdout)["findings"]] == ["AMP006"]
    convert = _venv_run(lint_venv, "convert", model("clean_cnn.py"), "-o", os.devnull)
    assert (convert.returncode, convert.stderr) == (
        2, f"ampaudit: error: ampaudit convert needs torch, which is not installed: {INSTALL}\n")
    for args in (["--version"], ["explain", "AMP401"], ["ops", "layer_norm", "--format", "json"]):
        assert _venv_run(lint_venv, *args).returncode == 0, args


def _hook_source(tmp_path: Path) -> Path:
    """This checkout's packaging as a one-commit git repo: try-repo installs the hook from a
    commit, and this way uncommitted and untracked work is what gets tested."""
    repo = tmp_path / "ampaudit-hook"
    repo.mkdir()
    for name in ("pyproject.toml", "README.md", ".pre-commit-hooks.yaml"):
        shutil.copy(ROOT / name, repo / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("ampaudit", "rules"):
        shutil.copytree(ROOT / name, repo / name, ignore=ignore)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "hook")
    return repo


def _git(repo: Path, *args: str) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, timeout=60)


def test_the_pre_commit_hook_installs_and_runs_without_torch(wheelhouse, tmp_path):
    pytest.importorskip("pre_commit", reason="pre-commit is not installed (the dev extra installs it)")
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    hook = _hook_source(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(RULE_FIXTURES / "AMP405_invalid.py", project / "train_bug.py")
    shutil.copy(ROOT / "fixtures" / "scripts" / "clean_amp_loop.py", project / "train_clean.py")
    (project / "notes.txt").write_text("optimizer.step()\n")  # not Python: the hook never sees it
    _git(project, "init", "-q")
    _git(project, "add", "-A")
    home = tmp_path / "pre-commit-home"
    proc = subprocess.run([sys.executable, "-m", "pre_commit", "try-repo", str(hook), "ampaudit", "--all-files"],
                          cwd=project, env=_offline_env(PRE_COMMIT_HOME=str(home), PIP_FIND_LINKS=str(wheelhouse)),
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "ampaudit" in out and "Failed" in out
    assert "train_bug.py:" in out and "AMP405" in out
    assert "train_clean.py:" not in out and "notes.txt" not in out
    # pip installed the hook with --no-index from the wheelhouse, which holds no torch: a hook
    # that needed torch would have failed to install
    assert not list(wheelhouse.glob("torch-*")) and not list(wheelhouse.glob("safetensors-*"))
