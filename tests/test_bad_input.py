"""Every class of bad input: one clear line on stderr, exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
    "bad-shape-flag": ([model("input_shape.py"), "--input-shape", "2,x"], "--input-shape '2,x'"),
    "shape-mismatch": ([model("input_shape.py"), "--input-shape", "2,9"],
                       "the example inputs (--input-shape) fail to run the model"),
    "bad-dtype-flag": ([model("input_shape.py"), "--input-shape", "2,8", "--input-dtype", "float12"],
                       "unknown dtype 'float12'"),
    "missing-policy": ([model("input_shape.py"), "--policy", "nope.toml"], "policy file not found: nope.toml"),
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
