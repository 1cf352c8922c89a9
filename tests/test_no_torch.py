"""Without torch (``pip install ampaudit`` alone), the lint, ``--help``, ``rules``, ``explain``,
``ops`` and ``report`` work exactly as with it and never import torch - not at import time, not
lazily; a model file gets its lint plus AMP006; ``convert``, ``run``, a named model and the torch
APIs fail with one line naming ``pip install "ampaudit[torch]"``.

Each command runs in a subprocess whose ``sitecustomize`` puts a ``sys.meta_path`` finder first
that refuses ``torch`` and its submodules, logs every attempt, and at exit logs whether torch got
into ``sys.modules`` anyway. Worker processes (the parallel lint) inherit it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ampaudit.core.torch_extra import INSTALL, TorchMissing, import_needing_torch, require_torch
from tests.conftest import ROOT, RULE_FIXTURES, model

BLOCKER = '''\
import atexit, importlib.abc, os, sys

LOG = os.environ["AMPAUDIT_TEST_TORCH_LOG"]


def _log(line):
    with open(LOG, "a") as f:
        f.write(line + "\\n")


class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            _log("attempt " + name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoTorch())
atexit.register(lambda: "torch" in sys.modules and _log("in sys.modules"))
'''

NO_TORCH_LINE = f'ampaudit: error: {{}} needs torch, which is not installed: {INSTALL}\n'
FOLDER = "fixtures/trainers"  # 29 files: the lint runs in worker processes


@pytest.fixture(scope="module")
def blocker(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("no_torch")
    (folder / "sitecustomize.py").write_text(BLOCKER)
    return folder


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, log: Path) -> None:
        self.code, self.out, self.err = proc.returncode, proc.stdout, proc.stderr
        self.torch = log.read_text().splitlines() if log.exists() else []


def _without_torch(blocker: Path, tmp_path: Path, *args: str, code: str | None = None) -> Run:
    log = tmp_path / f"torch-{len(list(tmp_path.glob('torch-*')))}.log"
    env = {**os.environ, "AMPAUDIT_TEST_TORCH_LOG": str(log), "COLUMNS": "100",
           "PYTHONPATH": os.pathsep.join([str(blocker), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = ["-c", code] if code is not None else ["-m", "ampaudit", *args]
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return Run(proc, log)


def test_the_blocker_blocks(blocker, tmp_path):
    run = _without_torch(blocker, tmp_path, code="import torch")
    assert run.code == 1 and "ModuleNotFoundError: No module named 'torch'" in run.err
    assert run.torch == ["attempt torch"]


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["rules"], ["rules", "--format", "json"],
                                  ["explain", "AMP006"], ["ops", "softmax"], ["check", "--help"]])
def test_commands_that_never_need_torch(blocker, tmp_path, cli, args):
    run = _without_torch(blocker, tmp_path, *args)
    assert run.code == 0, run.err
    assert run.torch == []
    if args[0] in ("rules", "explain") and args[-1] != "rules":
        assert run.out == cli(*args).out  # the catalog and the rulebook are data


@pytest.mark.parametrize("args", [[FOLDER], [FOLDER, "--select", "AMP4"], ["--lint-only", model("clean_cnn.py")],
                                  [str(RULE_FIXTURES / "AMP401_invalid.py"), "--lint-only"]])
def test_the_lint_is_the_same_without_torch(blocker, tmp_path, cli, args):
    with_torch = cli("check", "--format", "json", *args)
    run = _without_torch(blocker, tmp_path, "check", "--format", "json", *args)
    assert run.torch == []
    assert (run.code, run.out) == (with_torch.code, with_torch.out)
    assert json.loads(run.out)["findings"] or "--lint-only" in args


def test_the_text_report_is_the_same_without_torch(blocker, tmp_path, cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with_torch = cli("check", FOLDER)
    run = _without_torch(blocker, tmp_path, "check", FOLDER)
    assert run.torch == []
    assert (run.code, run.out) == (with_torch.code, with_torch.out)


def test_a_model_file_gets_its_lint_and_amp006(blocker, tmp_path, cli):
    path = str(RULE_FIXTURES / "AMP006_invalid.py")
    run = _without_torch(blocker, tmp_path, "check", "--format", "json", path)
    assert run.code == 1, run.err  # exit by the findings: AMP006 is an info, AMP401 a warning
    assert run.torch == ["attempt torch"]  # asked once, never imported
    report = json.loads(run.out)
    amp006 = [f for f in report["findings"] if f["rule"] == "AMP006"]
    assert [(f["line"], f["severity"]) for f in amp006] == [(5, "info")]
    assert INSTALL in amp006[0]["message"] and "torch, which is not installed" in amp006[0]["message"]
    assert report["target"]["trace"] == "none"
    lint = cli("check", "--format", "json", "--lint-only", path).json()["findings"]
    assert [f for f in report["findings"] if f["rule"] != "AMP006"] == lint


def test_a_model_file_with_fail_on_info_fails_by_its_findings(blocker, tmp_path):
    run = _without_torch(blocker, tmp_path, "check", model("clean_cnn.py"), "--fail-on", "info")
    assert run.code == 1, run.err
    assert "AMP006" in run.out and "ampaudit: error" not in run.err


@pytest.mark.parametrize(("args", "what"), [
    (["convert", model("clean_cnn.py"), "-o", "{tmp}/out"], "ampaudit convert"),
    (["run", "--log", "{tmp}/log.jsonl", "fixtures/scripts/clean_amp_loop.py"], "ampaudit run"),
    (["check", model("clean_cnn.py") + ":get_model"], f"auditing {model('clean_cnn.py')}:get_model"),
    (["check", "torch.nn:Linear(4, 4)"], "auditing torch.nn:Linear(4, 4)"),
])
def test_torch_commands_say_how_to_install_it(blocker, tmp_path, args, what):
    run = _without_torch(blocker, tmp_path, *(a.format(tmp=tmp_path) for a in args))
    assert (run.code, run.out, run.err) == (2, "", NO_TORCH_LINE.format(what))
    assert "in sys.modules" not in run.torch
    assert not (tmp_path / "out").exists() and not (tmp_path / "log.jsonl").exists()


def test_the_python_apis_raise_an_import_error_naming_the_install(blocker, tmp_path):
    code = ("import ampaudit\n"
            "from ampaudit.core.errors import AmpauditError\n"
            "for call in (lambda: ampaudit.watch(None), lambda: ampaudit.convert(None), lambda: ampaudit.check(None),\n"
            "             lambda: ampaudit.apply):\n"
            "    try:\n"
            "        call()\n"
            "    except ImportError as exc:\n"
            "        assert isinstance(exc, AmpauditError), type(exc)\n"
            "        print(exc)\n"
            "print(ampaudit.Report.__name__)\n")
    run = _without_torch(blocker, tmp_path, code=code)
    assert run.code == 0, run.err
    assert run.out.splitlines() == [f"ampaudit.{api} needs torch, which is not installed: {INSTALL}"
                                    for api in ("watch()", "convert()", "check()", "apply")] + ["Report"]
    assert "in sys.modules" not in run.torch


@pytest.fixture(scope="module")
def watch_log(tmp_path_factory) -> Path:
    """A real watch log of a three-step run (written with torch, in this process)."""
    from ampaudit.cli.main import main

    folder = tmp_path_factory.mktemp("watch_log")
    script = folder / "train.py"
    script.write_text("import torch\n\nmodel = torch.nn.Linear(4, 2)\n"
                      "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "for _ in range(3):\n    model(torch.randn(8, 4)).pow(2).mean().backward()\n"
                      "    opt.step()\n    opt.zero_grad()\n")
    log = folder / "run.jsonl"
    assert main(["run", "--log", str(log), str(script)]) == 0
    return log


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_report_is_the_same_without_torch(blocker, tmp_path, cli, monkeypatch, watch_log, fmt):
    monkeypatch.setenv("COLUMNS", "100")
    with_torch = cli("report", "--format", fmt, watch_log)
    run = _without_torch(blocker, tmp_path, "report", "--format", fmt, str(watch_log))
    assert run.torch == []
    assert (run.code, run.out) == (0, with_torch.out)


def test_report_plot_needs_matplotlib_not_torch(blocker, tmp_path, watch_log):
    pytest.importorskip("matplotlib")
    run = _without_torch(blocker, tmp_path, "report", str(watch_log), "--plot", str(tmp_path / "plot.png"))
    assert run.code == 0, run.err
    assert run.torch == [] and (tmp_path / "plot.png").stat().st_size > 0


def test_report_tensorboard_names_its_extra(blocker, tmp_path, watch_log):
    run = _without_torch(blocker, tmp_path, "report", str(watch_log), "--tensorboard", str(tmp_path / "tb"))
    # the [tensorboard] extra brings torch too (torch.utils.tensorboard writes the events)
    assert (run.code, run.err) == (2, "ampaudit: error: --tensorboard needs tensorboard "
                                      "(pip install 'ampaudit[tensorboard]')\n")
    assert "in sys.modules" not in run.torch


# --- in-process: the helpers themselves ------------------------------------------------------


def test_torch_missing_is_an_import_error_and_an_ampaudit_error(monkeypatch):
    from ampaudit.core.errors import AmpauditError

    monkeypatch.setitem(sys.modules, "safetensors", None)  # `import safetensors` raises ImportError
    with pytest.raises(TorchMissing) as exc:
        require_torch("ampaudit convert", ("torch", "safetensors"))
    assert isinstance(exc.value, ImportError) and isinstance(exc.value, AmpauditError)
    assert exc.value.exit_code == 2
    assert str(exc.value) == f"ampaudit convert needs safetensors, which is not installed: {INSTALL}"
    require_torch("ampaudit run")  # torch is here


def test_a_broken_torch_says_so(monkeypatch, tmp_path):
    (tmp_path / "fake_torch_dep.py").write_text("raise ImportError('libtorch_cpu.so: cannot open shared object')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TorchMissing, match=r"^x needs fake_torch_dep, which cannot be imported \(libtorch_cpu.so: "
                                           r"cannot open shared object\): pip install \"ampaudit\[torch\]\"$"):
        require_torch("x", ("fake_torch_dep",))


def test_only_torch_and_safetensors_become_torch_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "ampaudit_not_a_module", None)
    with pytest.raises(ImportError) as exc:
        import_needing_torch("ampaudit_not_a_module", "x")
    assert not isinstance(exc.value, TorchMissing)
