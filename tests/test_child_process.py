"""The process boundary (core/child.py): ``check FILE.py`` and ``convert`` run the model's code
in a child interpreter, so whatever that code does - exit, a signal, a segfault, a hang, an
allocation that cannot fit, endless recursion, ``os.chdir`` - ends in one line (or AMP005),
and every output stays as it was. These tests start the real child (marker ``child_process``)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
from conftest import ROOT, model

from ampaudit.core.dtypes import BFLOAT16, FLOAT16
from ampaudit.core.errors import ModelNotBuilt
from ampaudit.core.torch_extra import TorchMissing

pytest.importorskip("torch")

MODEL = '''import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).softmax(-1)


def example_inputs():
    return (torch.randn(2, 4),)


def get_model():
    print("hello from the model")
    BODY
    return Net()
'''
BODY_LINE = MODEL.splitlines().index("    BODY") + 1

HOSTILE = {  # the body of get_model(), and what AMP005 says of it
    "os-exit": ("import os; os._exit(0)", "the model's code exited with status 0 (os._exit?) while importing m.py"),
    "kill-9": ("import os; os.kill(os.getpid(), 9)", "the model's code was killed by SIGKILL (out of memory? "
                                                     "the system's out-of-memory killer sends it)"),
    "segfault": ("import ctypes; ctypes.string_at(0)",
                 "the model's code crashed (SIGSEGV, a segmentation fault in native code)"),
    "hang": ("while True: pass", f"importing m.py was still running after 1 s, stopped at line {BODY_LINE}"),
    "100-GB": ("torch.zeros(100 * 2**30, dtype=torch.uint8)", "DefaultCPUAllocator: can't allocate memory"),
    "recursion": ("f = lambda n: f(n + 1); f(0)", "get_model() raised RecursionError: maximum recursion depth"),
}


def _write(tmp_path, body: str) -> bytes:
    source = MODEL.replace("BODY", body).encode()
    (tmp_path / "m.py").write_bytes(source)
    return source


@pytest.mark.child_process
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_model_that_misbehaves_gets_amp005_and_the_report_is_written(cli, tmp_path, monkeypatch, case):
    body, cause = HOSTILE[case]
    source = _write(tmp_path, body)
    monkeypatch.chdir(tmp_path)
    result = cli("check", "m.py", "--format", "json", "-o", "report.json", "--import-timeout", "1")
    assert result.code == 0 and result.out == "", result.err  # AMP005 is info: exit by findings
    assert "hello from the model" in result.err  # the model's prints go to stderr
    (finding,) = json.loads((tmp_path / "report.json").read_text())["findings"]
    assert finding["rule"] == "AMP005" and cause in finding["message"], finding
    assert finding["line"] == (BODY_LINE if case in ("hang", "100-GB", "recursion") else 1)
    assert (tmp_path / "m.py").read_bytes() == source
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.py", "report.json"]


@pytest.mark.child_process
@pytest.mark.parametrize("case", ["os-exit", "segfault"])
def test_a_named_model_that_misbehaves_is_one_line_and_exit_2_and_the_output_stays(cli, tmp_path, monkeypatch,
                                                                                    case):
    _write(tmp_path, HOSTILE[case][0])
    (tmp_path / "report.json").write_text("the earlier report\n")
    monkeypatch.chdir(tmp_path)
    result = cli("check", "m.py:get_model", "-o", "report.json")
    assert result.code == 2
    assert result.err.strip().splitlines()[-1] == "ampaudit: error: importing m.py: " + HOSTILE[case][1].split(
        " while ")[0]
    assert (tmp_path / "report.json").read_text() == "the earlier report\n"


@pytest.mark.child_process
def test_chdir_in_the_model_moves_neither_the_output_nor_the_reports_paths(cli, tmp_path, monkeypatch):
    import resource

    limit_file = tmp_path / "limit.txt"
    _write(tmp_path, f"import os, resource; open({str(limit_file)!r}, 'w').write("
                     "str(resource.getrlimit(resource.RLIMIT_AS)[0])); os.chdir('/')")
    monkeypatch.chdir(tmp_path)
    result = cli("check", "m.py", "--format", "json", "-o", "report.json")
    assert result.code == 0, result.err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["target"]["file"] == "m.py" and report["target"]["trace"] == "fx" and report["nodes"]
    assert {n["file"] for n in report["nodes"] if n.get("file")} == {"m.py"}
    from ampaudit.core.child import memory_limit

    expected = memory_limit()
    assert int(limit_file.read_text()) == (expected if expected else resource.RLIM_INFINITY)


@pytest.mark.child_process
def test_convert_whose_model_dies_while_converting_leaves_the_earlier_export(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "pass")
    assert cli("convert", "m.py", "-o", "out", "--train-steps", "0").code == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    # the forward exits the process: after the import, during the conversion
    (tmp_path / "m.py").write_text(MODEL.replace("BODY", "pass").replace(
        "return self.fc(x).softmax(-1)", "import os\n        if not torch.is_grad_enabled() or x.dtype != "
                                         "torch.float32: os._exit(7)\n        return self.fc(x).softmax(-1)"))
    result = cli("convert", "m.py", "-o", "out", "--train-steps", "0")
    assert result.code == 2
    assert result.err.strip().splitlines()[-1] == \
        "ampaudit: error: the child process running the model exited with status 7 (os._exit?)"
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if ".ampaudit-" in p.name] == []


@pytest.mark.child_process
def test_the_readme_example_is_byte_identical_to_the_in_process_audit_and_the_parent_never_imports_torch(tmp_path):
    from ampaudit.check.api import check_path
    from ampaudit.report.formats import render_machine

    target = model("clean_transformer.py")
    program = ("import sys; from ampaudit.cli.main import main; "
               f"code = main(['check', {target!r}, '--format', 'json', '-o', {str(tmp_path / 'r.json')!r}]); "
               "print(code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["0", "False"], done.stderr
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        expected = render_machine(check_path(target), "json")
    finally:
        os.chdir(cwd)
    assert (tmp_path / "r.json").read_text() == expected


def test_errors_and_dtypes_cross_the_boundary_whole():
    error = pickle.loads(pickle.dumps(ModelNotBuilt("m", reason="r", hint="h", line=3)))
    assert (str(error), error.reason, error.hint, error.line) == ("m", "r", "h", 3)
    missing = pickle.loads(pickle.dumps(TorchMissing("x needs torch", "torch, which is not installed")))
    assert isinstance(missing, ImportError) and missing.missing == "torch, which is not installed"
    # by name: unpickling a report in the parent must not import torch for the dtype's cached torch.dtype
    assert FLOAT16.torch is not None and b"torch" not in pickle.dumps(FLOAT16)
    assert pickle.loads(pickle.dumps(BFLOAT16)) is BFLOAT16
