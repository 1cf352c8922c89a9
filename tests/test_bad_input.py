"""Every class of bad input: one clear line on stderr, exit code 2, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ampaudit.cli.main import main
from tests.conftest import ROOT, model

CASES = {
    "missing-file": (["fixtures/models/does_not_exist.py"],
                     "no such file or folder: fixtures/models/does_not_exist.py"),
    "syntax-error": ([model("bad_syntax.py")], "syntax error in fixtures/models/bad_syntax.py:9:"),
    # A named model that cannot be built is an error; unnamed, the file is linted (AMP005, tests/test_graph_skipped.py).
    "import-error": ([model("bad_import.py") + ":get_model"],
                     "no module named 'flash_attn_does_not_exist' (fixtures/models/bad_import.py:8)"),
    "no-model-named": ([model("no_model.py") + ":make"], "defines no top-level 'make'"),
    "unknown-name": ([model("named_entries.py") + ":nope"], "defines no top-level 'nope'"),
    "class-needs-args": ([model("named_entries.py") + ":Encoder"], "Encoder() needs arguments (dim)"),
    "factory-raises": ([model("factory_raises.py") + ":get_model"],
                       "get_model() raised ValueError: unsupported config: hidden=7 is not divisible by heads=2 "
                       "(fixtures/models/factory_raises.py:23)"),
    "inputs-fail": ([model("bad_inputs.py")],
                    "the example inputs (example_inputs()) fail to run the model: RuntimeError: mat1 and mat2 "
                    "shapes cannot be multiplied"),
    "non-tensor-output": ([model("non_tensor_output.py")], "the model's output holds no tensor (got dict)"),
    # LlamaGen's shape: an inference path in eval mode; the error says train mode runs
    "train-only-forward": ([model("train_only_forward.py")],
                           "(fixtures/models/train_only_forward.py:21) - in eval mode, which the audit runs it in"),
    "bad-shape-flag": ([model("input_shape.py"), "--input-shape", "2,x"], "--input-shape '2,x'"),
    "shape-mismatch": ([model("input_shape.py"), "--input-shape", "2,9"],
                       "the example inputs (--input-shape) fail to run the model"),
    "bad-dtype-flag": ([model("input_shape.py"), "--input-shape", "2,8", "--input-dtype", "float12"],
                       "unknown dtype 'float12'"),
    "missing-policy": ([model("input_shape.py"), "--policy", "nope.toml"], "policy file not found: nope.toml"),
    # the lint reads no catalog: a --policy given with it was not even opened
    "missing-policy-lint-only": ([model("input_shape.py"), "--lint-only", "--policy", "nope.toml"],
                                 "policy file not found: nope.toml"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_and_exit_2(cli, case):
    args, expected = CASES[case]
    result = cli("check", *args)
    assert result.code == 2
    assert result.out == ""
    assert "Traceback" not in result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith("ampaudit: error: ")
    assert expected in lines[0]


@pytest.mark.parametrize("entry", ["", ":Model"])  # linted, and loaded to be built
def test_a_syntax_error_names_the_grammar_that_refused_it(cli, tmp_path, entry):
    # valid from Python 3.12 on (PEP 701: an f-string reuses its quotes); elsewhere a plain error
    script = tmp_path / "newer.py"
    script.write_text('import torch\npath = "x"\nprint(f"{str(path + "checkpoints")}")\n' if sys.version_info < (3, 12)
                      else "import torch\ndef f(:\n    pass\n")
    result = cli("check", f"{script}{entry}")
    version = f"Python {sys.version_info.major}.{sys.version_info.minor}'s grammar"
    assert result.code == 2 and result.err.count("\n") == 1
    assert result.err.startswith("ampaudit: error: syntax error in ") and result.err.rstrip().endswith(f"({version})")


# Nested past what ampaudit's deep stack walks (a 100,000-term sum: RecursionError) and past the
# parser's own stack (100,000 unary minus signs: CPython 3.11's parser says MemoryError).
_DEEP = {"sum": "y = " + " + ".join(["1"] * 100_000) + "\n", "minus": "y = " + "-" * 100_000 + "1\n"}
_MODEL_HEAD = "import torch\n\n\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n\n\n"


@pytest.mark.parametrize("shape", sorted(_DEEP))
@pytest.mark.parametrize("argv", [["check", "--lint-only", "deep.py"], ["check", "deep.py"],
                                  ["check", "deep.py:Model"], ["convert", "deep.py", "-o", "out"]])
def test_a_file_nested_too_deeply_is_one_line_naming_it(cli, tmp_path, monkeypatch, shape, argv):
    # was "unexpected RecursionError" / "unexpected MemoryError": the import-safety scan ran even
    # under --lint-only and let both through; convert said "ran out of memory" for the second
    monkeypatch.chdir(tmp_path)
    (tmp_path / "deep.py").write_text(_MODEL_HEAD + _DEEP[shape])
    result = cli(*argv)
    assert result.code == 2 and result.out == "" and "Traceback" not in result.err
    assert result.err == "ampaudit: error: deep.py: nested too deeply to parse (more than Python's own parser allows)\n"
    assert not (tmp_path / "out").exists()


def test_a_folder_lints_a_file_nested_past_the_parsers_stack_as_amp004(cli, tmp_path):
    # the parser's MemoryError stopped the whole walk ("unexpected MemoryError")
    (tmp_path / "deep.py").write_text("import torch\n" + _DEEP["minus"])
    (tmp_path / "train.py").write_text("import torch\nscaler = torch.cuda.amp.GradScaler()\n")
    result = cli("check", str(tmp_path), "--format", "json")
    findings = {(Path(f["file"]).name, f["rule"]) for f in json.loads(result.out)["findings"]}
    assert result.code == 1 and findings == {("deep.py", "AMP004"), ("train.py", "AMP401")}


def test_fix_of_a_deeply_nested_file_is_written(cli, tmp_path):
    # linted on a deep stack, then checked to still parse on the default one: "unexpected RecursionError"
    script = tmp_path / "train.py"
    script.write_text("import torch\nscaler = torch.cuda.amp.GradScaler()\n" + "y = " + " + ".join(["1"] * 20_000))
    result = cli("check", "--lint-only", "--fix", str(script))
    assert result.code == 0, result.err
    assert script.read_text().startswith('import torch\nscaler = torch.amp.GradScaler("cuda")\ny = 1 + 1')


def test_debug_shows_the_traceback(cli):
    result = cli("check", model("factory_raises.py") + ":get_model", "--debug")
    assert result.code == 2
    assert "Traceback" in result.err
    assert "hidden=7 is not divisible" in result.err


def test_unknown_option_is_a_usage_error(cli):
    with pytest.raises(SystemExit) as exc:
        cli("check", model("clean_cnn.py"), "--frobnicate")
    assert exc.value.code == 2


def test_console_script_exit_code_and_no_traceback():
    # The real entry point, in a fresh process: the same contract holds end to end.
    proc = subprocess.run([sys.executable, "-m", "ampaudit", "check", model("bad_import.py") + ":get_model"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("ampaudit: error: cannot import fixtures/models/bad_import.py: no module named "
                                   "'flash_attn_does_not_exist' (fixtures/models/bad_import.py:8)")


# -- every command: each bad input of the safety issue, one line and the right exit code ------------

MODEL = "import torch\nfrom torch import nn\n\n\ndef get_model():\n    return nn.Linear(4, 4)\n\n\n" \
        "def example_inputs():\n    return (torch.ones(2, 4),)\n"


def _files(tmp: Path, case: str) -> None:
    """The files each case needs, in a fresh folder (also the cwd)."""
    (tmp / "m.py").write_text(MODEL)
    (tmp / "t.py").write_text("print('hi')\n")
    (tmp / "log.jsonl").write_text('{"ampaudit_watch": 1, "dtype": "float16"}\n')
    config = {
        "cfg-select": "select = 5", "cfg-tool": None, "cfg-ops": "[tool.ampaudit.policy]\nops = 3",
        "cfg-group": "[tool.ampaudit.policy]\ngroup = 3",
        "cfg-module-kind": '[tool.ampaudit.policy.modules]\n"torch.nn.Linear" = "lienar"',
    }
    if case == "cfg-tool":
        (tmp / "pyproject.toml").write_text("tool = 5\n")
    elif case in config:
        (tmp / "pyproject.toml").write_text(f"[tool.ampaudit]\n{config[case]}\n")
    bodies = {
        "exit-in-forward": "import sys\nimport torch\nfrom torch import nn\n\n\nclass Net(nn.Module):\n"
                           "    def forward(self, x):\n        sys.exit(4)\n\n\ndef example_inputs():\n"
                           "    return (torch.ones(1),)\n",
        "exit-in-inputs": MODEL.replace("return (torch.ones(2, 4),)", "raise SystemExit(9)"),
        "exit-message-in-factory": MODEL.replace("return nn.Linear(4, 4)", "raise SystemExit('no GPU here')"),
        "generator-exit": MODEL.replace("return nn.Linear(4, 4)", "raise GeneratorExit"),
        "meta-inputs": MODEL.replace("torch.ones(2, 4)", "torch.ones(2, 4, device='meta')"),
        "hangs": MODEL.replace("def get_model():", "def get_model():\n    while True: pass"),  # one line
        "inputs-nested-deep": MODEL.replace("return (torch.ones(2, 4),)",
                                            "x = torch.ones(2, 4)\n    for _ in range(1000):\n        x = [x]\n"
                                            "    return (x,)"),
    }
    if case in bodies:
        (tmp / "m.py").write_text(bodies[case])
    (tmp / "data.jsonl").write_text('{"mine": 1}\n')
    (tmp / "bytes.jsonl").write_bytes(b"\xff\xfe\x00garbage\n")
    (tmp / "list.jsonl").write_text('{"ampaudit_watch": 1, "dtype": "float16"}\n[1, 2]\n')
    (tmp / "folder").mkdir()
    os.mkfifo(tmp / "pipe")
    (tmp / "dangling").symlink_to(tmp / "gone")
    if case.endswith("symlink-loop"):
        (tmp / "loop.py").symlink_to("loop.py")  # ELOOP
    for name, manifest in (("exp-list", "[1, 2]"), ("exp-number", '{"files": 5}')):
        (tmp / name).mkdir()
        (tmp / name / "ampaudit-export.json").write_text(manifest)


# case -> (argv, exit code, what the one stderr line says)
EVERY_COMMAND = {
    "cfg-select": (["check", "m.py"], 2, "select must be a list of rule codes"),
    "cfg-tool": (["check", "m.py"], 2, "[tool] must be a table, not int"),
    "cfg-ops": (["check", "m.py"], 2, "ops must be a table ([ops]), not int"),
    "cfg-group": (["check", "m.py"], 2, "group must be an array of tables"),
    "cfg-module-kind": (["check", "m.py"], 2, "torch.nn.Linear = 'lienar' is not an op kind (did you mean 'linear'?)"),
    "exit-in-forward": (["check", "m.py:Net"], 2, "exit(4) (m.py:8)"),
    "exit-in-inputs": (["check", "m.py"], 2, "example_inputs() raised exit(9) (m.py:10)"),
    "exit-message-in-factory": (["check", "m.py:get_model"], 2, "get_model() raised exit('no GPU here') (m.py:6)"),
    "generator-exit": (["check", "m.py:get_model"], 2, "get_model() raised GeneratorExit (m.py:6)"),
    "meta-inputs": (["check", "m.py"], 2, "are meta tensors (no values): they cannot run; pass --no-run"),
    "hangs": (["check", "m.py:get_model", "--import-timeout", "0.5"], 2,
              "importing m.py was stopped after 0.5 s at line 6 (--import-timeout)"),
    "inputs-nested-deep": (["check", "m.py"], 2, "example_inputs() gave containers nested more than 32 deep"),
    "input-shape-too-big": (["check", "m.py:get_model", "--input-shape", "100000,100000,100000"], 2,
                            "--input-shape 100000,100000,100000: 3,725,290.3 GiB of float32 cannot be allocated"),
    "timeout-negative": (["check", "m.py", "--import-timeout", "-1"], 2, "'-1' is not a number of seconds from 0.01"),
    "timeout-tiny": (["check", "m.py", "--import-timeout", "1e-9"], 2, "'1e-9' is not a number of seconds from 0.01"),
    "timeout-huge": (["convert", "m.py", "-o", "out", "--import-timeout", "1e308"], 2,
                     "'1e308' is not a number of seconds from 0.01 to 86400 (a day), or 0 for no limit"),
    "check-output-is-input": (["check", "m.py", "-o", "m.py"], 2, "is an input of this command"),
    "tolerance-nan": (["convert", "m.py", "-o", "out", "--tolerance", "nan"], 2, "'nan' is not a finite relative"),
    "tolerance-negative": (["convert", "m.py", "-o", "out", "--tolerance", "-1"], 2, "'-1' is not a finite relative"),
    # was accepted: "finite" said, inf taken (every fp8/fp16 conversion then passed its check)
    "tolerance-inf": (["convert", "m.py", "-o", "out", "--tolerance", "inf"], 2, "'inf' is not a finite relative"),
    "convert-onto-file": (["convert", "m.py", "-o", "t.py"], 2, "-o t.py is a file"),
    "convert-empty-output": (["convert", "m.py", "-o", ""], 2, "an empty path"),
    "every-zero": (["run", "--every", "0", "t.py"], 2, "'0' is not a whole number >= 1"),
    # allocated 4 GB per Linear operand and hung the run
    "fp8-history-huge": (["run", "--fp8", "--fp8-history", "1000000000", "t.py"], 2,
                         "'1000000000' is not a whole number from 1 to 4096"),
    # was silently ignored
    "fp8-history-without-fp8": (["run", "--fp8-history", "4", "t.py"], 2, "--fp8-history goes with --fp8"),
    "log-missing-folder": (["run", "--log", "nowhere/x.jsonl", "t.py"], 2, "no folder nowhere"),
    "log-onto-folder": (["run", "--log", "folder", "t.py"], 2, "--log folder is a folder: name a file"),
    "log-onto-user-data": (["run", "--log", "data.jsonl", "t.py"], 2,
                           "the log data.jsonl exists and is not an ampaudit watch log: refusing to overwrite it"),
    "log-onto-script": (["run", "--log", "t.py", "t.py"], 2, "is an input of this command"),
    "report-missing": (["report", "nope.jsonl"], 2, "cannot read nope.jsonl"),
    "report-not-utf8": (["report", "bytes.jsonl"], 2, "bytes.jsonl:1: not UTF-8 text"),
    "report-not-object": (["report", "list.jsonl"], 2, "list.jsonl:2: a list, not a JSON object"),
    "report-not-a-log": (["report", "data.jsonl"], 2, "data.jsonl is not an ampaudit watch log"),
    "plot-not-image": (["report", "log.jsonl", "--plot", "x.txt"], 2, "--plot x.txt: name an image file"),
    "check-empty-target": (["check", ""], 2, "an empty PATH (an unset variable?): name a file or folder"),
    "check-fifo-target": (["check", "pipe"], 2, "pipe is not a regular file or a folder (a FIFO or a device)"),
    # "no such file or folder": a loop exists, it only cannot be followed
    "check-symlink-loop": (["check", "--lint-only", "loop.py"], 2,
                           "loop.py: a symlink loop (too many levels of symbolic links)"),
    "check-named-symlink-loop": (["check", "loop.py:Net"], 2, "loop.py: a symlink loop (too many levels"),
    "convert-symlink-loop": (["convert", "loop.py", "-o", "out"], 2, "loop.py: a symlink loop (too many levels"),
    "run-symlink-loop": (["run", "loop.py"], 2, "loop.py: a symlink loop (too many levels of symbolic links)"),
    "check-output-name-too-long": (["check", "t.py", "--lint-only", "-o", "a" * 300], 2, "File name too long"),
    "check-output-fifo-no-reader": (["check", "t.py", "--lint-only", "-o", "pipe"], 2,
                                    "-o pipe is a FIFO that no process reads: nothing written"),
    "convert-dangling-output": (["convert", "m.py", "-o", "dangling"], 2, "does not exist"),
    "convert-output-under-a-file": (["convert", "m.py", "-o", "t.py/out"], 2, "t.py is a file, not a folder"),
    "convert-manifest-list": (["convert", "m.py", "-o", "exp-list"], 2, "holds no earlier ampaudit export"),
    "convert-manifest-number": (["convert", "m.py", "-o", "exp-number"], 2, "holds no earlier ampaudit export"),
    "log-full-disk": (["run", "--log", "/dev/full", "t.py"], 2, "cannot write the log /dev/full: No space left"),
    "report-fifo": (["report", "pipe"], 2, "the log pipe is not a regular file (a FIFO or a device): not read"),
    "explain-unknown": (["explain", "AMP999"], 2, "AMP999"),
    "ops-missing-policy": (["ops", "--policy", "nope.toml"], 2, "policy file not found: nope.toml"),
    "rules-bad-format": (["rules", "--format", "xml"], 2, "invalid choice: 'xml'"),
}


@pytest.mark.parametrize("case", [  # a hang is stopped by the parent of the real child process
    pytest.param(c, marks=pytest.mark.child_process) if c == "hangs" else c for c in sorted(EVERY_COMMAND)])
def test_every_command_bad_input_is_one_line(tmp_path, monkeypatch, capsys, case):
    argv, code, expected = EVERY_COMMAND[case]
    _files(tmp_path, case)
    monkeypatch.chdir(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and not p.is_fifo()}
    try:
        result = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        result = exc.code
    out, err = capsys.readouterr()
    assert result == code, err
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ampaudit: error: "), err
    assert expected in lines[0]
    # no input and no bystander file was touched
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and not p.is_fifo()} == before


def test_debug_on_an_unexpected_error_prints_the_traceback_and_exits_2(cli, tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text(MODEL.replace("return nn.Linear(4, 4)", "raise GeneratorExit"))
    monkeypatch.chdir(tmp_path)
    result = cli("check", "m.py:get_model", "--debug")
    assert result.code == 2 and "Traceback" in result.err and "GeneratorExit" in result.err


def test_run_passes_the_scripts_exit_code_and_message(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("import sys\nsys.exit(4)\n")
    (tmp_path / "b.py").write_text("import sys\nsys.exit('stopped: no data')\n")
    assert cli("run", "--log", "a.jsonl", "a.py").code == 4
    result = cli("run", "--log", "b.jsonl", "b.py")
    assert result.code == 1 and "stopped: no data" in result.err.splitlines()


def test_user_output_never_reaches_stdout_in_json_mode(tmp_path):
    # print, sys.__stdout__ and the raw file descriptor: all to stderr, so stdout parses as JSON
    (tmp_path / "m.py").write_text(MODEL.replace(
        "def get_model():\n", "def get_model():\n    import os, sys\n    print('p')\n"
        "    sys.__stdout__.write('d\\n')\n    os.write(1, b'fd\\n')\n"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout, whatever is installed
    proc = subprocess.run([sys.executable, "-m", "ampaudit", "check", "m.py", "--format", "json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    assert json.loads(proc.stdout)["findings"] == []
    assert proc.stderr.splitlines()[:3] == ["p", "d", "fd"]


def _readme_exit_table() -> set[tuple[str, int]]:
    """(command, code) for every cell of README's exit-code table that is not a dash."""
    lines = (ROOT / "README.md").read_text().split("## Exit codes", 1)[1].split("\n\n")[1].splitlines()
    header = [cell.strip(" `") for cell in lines[0].strip("|").split("|")][1:]
    cells = set()
    for row in lines[2:]:
        code, *values = (cell.strip() for cell in row.strip("|").split("|"))
        for commands, value in zip(header, values, strict=True):
            if value != "—":
                cells |= {(command.strip(" `"), int(code)) for command in commands.split(",")}
    return cells


EXIT_CODE_CASES = {  # (command, code) -> argv; files from _files(), cwd in that folder
    ("check", 0): ["check", "m.py"],
    ("check", 1): ["check", "--lint-only", "amp.py"],
    ("check", 2): ["check", "nope.py"],
    ("convert", 0): ["convert", "m.py", "-o", "out"],
    ("convert", 1): ["convert", "m.py", "-o", "out", "--tolerance", "0"],  # with a forced error, below
    ("convert", 2): ["convert", "m.py", "-o", "t.py"],
    ("run", 0): ["run", "--log", "r.jsonl", "t.py"],
    ("run", 1): ["run", "--log", "r.jsonl", "fails.py"],
    ("run", 2): ["run", "--every", "0", "t.py"],
    ("report", 0): ["report", "log.jsonl"],
    ("report", 1): ["report", str(ROOT / "fixtures" / "watch" / "AMP605_invalid.jsonl")],  # an error finding
    ("report", 2): ["report", "data.jsonl"],
    ("rules", 0): ["rules"],
    ("rules", 2): ["rules", "--format", "xml"],
    ("explain", 0): ["explain", "AMP101"],
    ("explain", 2): ["explain", "AMP999"],
    ("ops", 0): ["ops", "linear"],
    ("ops", 2): ["ops", "--policy", "nope.toml"],
}


def test_exit_codes_are_the_readmes(tmp_path, monkeypatch, capsys):
    assert set(EXIT_CODE_CASES) == _readme_exit_table()
    _files(tmp_path, "")
    (tmp_path / "amp.py").write_text("import torch\nscaler = torch.cuda.amp.GradScaler()\n")
    (tmp_path / "fails.py").write_text("raise SystemExit(1)\n")
    monkeypatch.chdir(tmp_path)
    for (command, code), argv in EXIT_CODE_CASES.items():
        if (command, code) == ("convert", 1):
            import ampaudit.convert.api as api
            import ampaudit.convert.verify as verify

            for module in (api, verify):  # an error no promotion removes: the tolerance is out of reach
                monkeypatch.setattr(module, "output_error", lambda *a, **k: 0.5)
        try:
            result = main(argv)
        except SystemExit as exc:
            result = exc.code
        assert result == code, (argv, capsys.readouterr().err)
        capsys.readouterr()
        shutil.rmtree(tmp_path / "out", ignore_errors=True)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: __import__("ampaudit").check(None), r"ampaudit.check\(\) takes a torch.nn.Module as its model, not "
                                                 r"NoneType \(for a model file: from ampaudit.check.api import "
                                                 r"check_path"),
    (lambda: __import__("ampaudit").check(5), r"ampaudit.check\(\) takes a torch.nn.Module as its model, not int"),
    (lambda: __import__("ampaudit").convert("model.py"), r"ampaudit.convert\(\) takes a torch.nn.Module .* not str"),
    (lambda: __import__("ampaudit").watch(5), r"ampaudit.watch\(\) takes a torch.nn.Module .* not int"),
    (lambda: __import__("ampaudit").apply(None, "out"), r"ampaudit.apply\(\) takes a torch.nn.Module .* NoneType"),
])
def test_python_api_names_the_type_it_takes(call, message):
    with pytest.raises(TypeError, match=message):
        call()


def test_the_check_path_the_hint_names_exists():
    from ampaudit.check.api import check_path

    assert callable(check_path)


def _linear():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(4, 4))


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda a, x: a.convert(_linear(), example_inputs=x, tolerance=-1), ValueError, r"tolerance must be a finite"),
    (lambda a, x: a.convert(_linear(), example_inputs=x, tolerance=float("nan")), ValueError, r"tolerance must be"),
    (lambda a, x: a.convert(_linear(), example_inputs=x, train_steps=-5), ValueError,
     r"train_steps must be a whole number >= 0, not -5"),
    (lambda a, x: a.check(__import__("torch").jit.script(_linear()), example_inputs=x), TypeError,
     r"takes the module before torch.jit.script"),
    (lambda a, x: a.convert(__import__("torch").compile(_linear()), example_inputs=x), TypeError,
     r"takes the module before torch.compile: pass model._orig_mod"),
    (lambda a, x: a.autocast_policy(_linear(), {"plan": "x"}), Exception, r"a plan's \"plan\" is a list of records"),
])
def test_python_api_rejects_what_the_cli_rejects(call, error, message):
    torch = pytest.importorskip("torch")
    import ampaudit

    with pytest.raises(error, match=message):
        call(ampaudit, (torch.randn(2, 4),))


def test_fix_refuses_an_immutable_file(tmp_path, cli):
    path = tmp_path / "train.py"
    path.write_text("import torch\nscaler = torch.cuda.amp.GradScaler()\n")
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (needs root and a file system that supports it)")
    try:
        result = cli("check", "--lint-only", "--fix", str(path))
        assert result.code == 2
        assert result.err.strip() == (f"ampaudit: error: {path} cannot be written (immutable, or on a read-only "
                                      "file system): not rewritten")
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=False)
    assert "torch.cuda.amp.GradScaler()" in path.read_text()


def test_a_deleted_working_folder_is_one_line(tmp_path, monkeypatch, capsys):
    gone = tmp_path / "gone"
    gone.mkdir()
    (tmp_path / "t.py").write_text("x = 1\n")
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert main(["check", str(tmp_path / "t.py"), "--lint-only", "-o", "report.txt"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "ampaudit: error: the working folder was deleted: cd to an existing folder\n"


def _hostile_logs(tmp: Path) -> dict[str, str]:
    """A real log's header and first record, bent one way each (issue 25, item 3)."""
    header = {"ampaudit_watch": 2, "dtype": "float16", "every": 1, "world": 1,
              "row": ["numel", "nan", "inf", "neginf", "overflow", "underflow", "zero", "absmax", "hist_from"]}
    record = {"step": 0, "layers": {"(model)": {"forward": [32, 0, 0, 0, 0, 0, 0, 1.5, -4, 8]}},
              "params": {"weight": [16, 0, 0, 0, 0, 0, 0, 8.0, 3, 16]}, "scale": None, "skipped": False,
              "first_nonfinite": None, "nonfinite_params": []}
    bent = {
        "version-true": ({**header, "ampaudit_watch": True}, record),
        "huge-step": (header, {**record, "step": 10**30}),
        "deep": (header, "[" * 100_000 + "]" * 100_000),
        "first-module-number": (header, {**record, "first_nonfinite": {"module": 5}}),
        "string-in-row": (header, {**record, "params": {"weight": [16, 0, 0, "x", 0, 0, 0, 8.0, 3, 16]}}),
        "v1-missing-nan": ({"ampaudit_watch": 1, "dtype": "float16"},
                           {"step": 0, "layers": {"a": {"forward": {"numel": 4, "inf": 0, "hist": []}}}, "params": {}}),
        "end-evals-number": ({**header, "ampaudit_watch": 3}, {"end": {"steps": 1, "eval_forwards": 4}}),
        "end-extra-key": ({**header, "ampaudit_watch": 3}, {"end": {}, "final_scale": 2.0, "x": 1}),
        # the end is the last line: a step after it (two logs joined) was read as if part of the run
        "end-in-the-middle": ({**header, "ampaudit_watch": 3}, {"end": {"steps": 1}}),
        # float(10**400) overflowed deep inside the summary ("unexpected OverflowError")
        "fp8-bigint": ({**header, "ampaudit_watch": 3},
                       {**record, "fp8": {"(model)": {"kind": "Linear (what-if)", "input": {
                           "format": "e4m3", "numel": 32, "underflow": 10**400, "amax": 1.5}}}}),
        # json's int() refuses more than 4300 digits with a ValueError that is no JSONDecodeError
        "long-number": ({**header, "ampaudit_watch": 3}, '{"step": 0, "layers": {}, "params": {}, "scale": 1'
                        + "0" * 5000 + "}"),
        # a log two runs wrote at once (a file system without locks), or two logs joined
        "two-headers": ({**header, "ampaudit_watch": 3}, {**header, "ampaudit_watch": 3}),
    }
    for name, (head, first) in bent.items():
        lines = [head, first, record]
        (tmp / f"{name}.jsonl").write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return {
        "version-true": "version-true.jsonl is not an ampaudit watch log",
        "huge-step": "huge-step.jsonl:2: step must be a whole number from 0 to 2**53",
        "deep": "deep.jsonl:2: nested too deeply to be a log record",
        "first-module-number": "first-module-number.jsonl:2: first_nonfinite.module must be text",
        "string-in-row": "string-in-row.jsonl:2: params.weight: a row must be a list of numbers",
        "v1-missing-nan": "v1-missing-nan.jsonl:2: layers.a.forward: no nan",
        "end-evals-number": "end-evals-number.jsonl:2: end.eval_forwards must be {count: whole number, recorded: "
                            "true or false}",
        "end-extra-key": "end-extra-key.jsonl:2: not a step record (needs step, layers and params) nor the log's end",
        "end-in-the-middle": "end-in-the-middle.jsonl:3: a record after the log's end (line 2)",
        "fp8-bigint": "fp8-bigint.jsonl:2: fp8.(model).input.underflow must be a number",
        "long-number": "long-number.jsonl:2: a number too long to be a log's",
        "two-headers": "two-headers.jsonl:2: a second header: two runs wrote this log, or two logs were joined",
    }


def test_a_log_cannot_drive_the_terminal(tmp_path, capsys):
    """Module names in a log are anyone's text: an ESC in one was written raw by the module and
    fp8 tables (a window title set, the screen cleared)."""
    evil = "\x1b]0;PWNED\x07\x1b[2J"
    header = {"ampaudit_watch": 3, "dtype": "float16", "every": 1, "world": 1,
              "row": ["numel", "nan", "inf", "neginf", "overflow", "underflow", "zero", "absmax", "hist_from"]}
    row = {"format": "e4m3", "numel": 32, "underflow": 0, "delayed_saturated": 0, "delayed_underflow": 0,
           "amax": 1.5, "jump": 0.0, "history_amax": 0.0, "scale": 298.7, "delayed_scale": 298.7}
    record = {"step": 0, "layers": {evil: {"forward": [32, 0, 0, 0, 0, 0, 0, 1.5, -4, 8]}},
              "params": {evil + "w": [16, 0, 0, 0, 0, 0, 0, 8.0, 3, 16]}, "scale": None, "skipped": False,
              "first_nonfinite": None, "nonfinite_params": [],
              "fp8": {evil: {"kind": "Linear (what-if)", "input": row}}}
    log = tmp_path / "evil.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in (header, record, {"end": {"steps": 1}})))
    assert main(["report", str(log)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert out.count("\\x1b]0;PWNED") >= 3  # the layers table, the parameters, the fp8 table


@pytest.mark.parametrize("flags", [[], ["--tensorboard", "tb"]])
def test_hostile_logs_are_one_line_naming_the_line(tmp_path, monkeypatch, capsys, flags):
    monkeypatch.chdir(tmp_path)
    for name, expected in _hostile_logs(tmp_path).items():
        assert main(["report", f"{name}.jsonl", "--format", "json", *flags]) == 2, name
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"ampaudit: error: {expected}"), err
        assert len(err.strip().splitlines()) == 1 and "unexpected" not in err, err


@pytest.mark.parametrize(("name", "code", "expected"), [
    ("no_parameters.py", 0, None),
    ("complex_parameter.py", 2, "w is a complex parameter: ampaudit converts real floating-point models"),
    ("broken_backward.py", 2, "the training check failed in the model's own backward (in fp32, in eval mode, as "
                              "the check trains): RuntimeError: my "
                              "backward is broken (fixtures/unconvertible/broken_backward.py:9); pass --train-steps 0"),
])
def test_convert_on_a_model_it_cannot_handle_is_one_line(cli, tmp_path, name, code, expected):
    pytest.importorskip("safetensors")
    result = cli("convert", f"fixtures/unconvertible/{name}", "-o", tmp_path / "out", "--train-steps", "2")
    assert result.code == code, result.err
    if expected is not None:
        assert result.err.startswith(f"ampaudit: error: {expected}") and len(result.err.strip().splitlines()) == 1


@pytest.mark.parametrize("backend", ["fx", "modules"])
def test_convert_says_the_model_fails_on_its_inputs_and_that_train_mode_runs(cli, tmp_path, backend):
    # the fx backend's first run (recording how children are called) and the modules backend's
    # recording raised the model's error as 'unexpected RuntimeError' - an ampaudit bug, as worded
    result = cli("convert", model("train_only_forward.py"), "-o", tmp_path / "out", "--backend", backend)
    assert result.code == 2 and "Traceback" not in result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and "unexpected" not in lines[0]
    assert lines[0].startswith("ampaudit: error: the example inputs (example_inputs()) fail to run the model: "
                               "RuntimeError: The size of tensor a (16) must match")
    assert "in train mode it runs" in lines[0]
    assert not (tmp_path / "out").exists()
    bad = cli("convert", model("bad_inputs.py"), "-o", tmp_path / "out2", "--backend", backend)
    assert bad.code == 2 and "fail to run the model: RuntimeError: mat1 and mat2" in bad.err
    assert "train mode" not in bad.err  # fails either way: no hint


def test_the_train_mode_retry_leaves_the_models_batchnorm_statistics_as_they_were():
    import torch

    from ampaudit.check.api import check
    from ampaudit.core.errors import LoadError

    class TrainOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(4)

        def forward(self, x):
            if not self.training:
                raise RuntimeError("inference path needs a cache")
            return self.norm(x)

    net = TrainOnly().eval()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(LoadError, match="in train mode it runs"):
        check(net, example_inputs=(torch.randn(8, 4) * 5 + 3,), dtype=torch.float16)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_a_file_of_one_huge_line_is_refused_without_reading_it_whole(tmp_path):
    """`ampaudit report` given a file that is no log and holds no newline - a sparse file of
    zeros, a JSON dump - read its first line whole, and held it three times over while parsing:
    a 2 GB file under a 1 GB address-space limit ended in "unexpected MemoryError" (without one,
    swap or the OOM killer). A header longer than 1 MB is refused after reading 1 MB."""
    zeros = tmp_path / "zeros.bin"
    with open(zeros, "wb") as f:
        f.truncate(2 * 2**30)  # sparse: no disk taken
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))\n"
            "from ampaudit.cli.main import main\n"
            "sys.exit(main(['report', sys.argv[1]]))\n")
    done = subprocess.run([sys.executable, "-c", code, str(zeros)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"ampaudit: error: {zeros} is not an ampaudit watch log (its first line runs past 1 MB; "
                           "a log's header is a few hundred bytes)\n")
