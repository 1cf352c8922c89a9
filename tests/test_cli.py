"""The command line: version, fast help, exit codes, dtype, the main job from README."""

from __future__ import annotations

import subprocess
import sys
import time

from ampaudit import __version__
from tests.conftest import ROOT, model


def test_version(cli, capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:
        cli("--version")
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"ampaudit {__version__}"


def test_help_is_fast_and_does_not_import_torch():
    code = ("import sys, time; t = time.perf_counter(); from ampaudit.cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NOTORCH', time.perf_counter() - t)")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - start
    flag, seconds = proc.stdout.strip().splitlines()[-1].split()
    assert flag == "NOTORCH"
    assert float(seconds) < 0.5
    assert wall < 2.0  # interpreter start-up included, on a loaded CI machine


def test_no_command_prints_help_on_stderr_and_exits_2(cli):
    result = cli()
    assert result.code == 2 and result.out == "" and "check" in result.err


def test_exit_codes_follow_fail_on(cli):
    path = model("untraceable_no_inputs.py")  # one AMP002 warning
    assert cli("check", path).code == 1
    assert cli("check", path, "--fail-on", "error").code == 0
    assert cli("check", path, "--ignore", "AMP002").code == 0
    assert cli("check", model("clean_cnn.py")).code == 0


def test_bfloat16_dtype_is_reported(cli):
    doc = cli("check", model("clean_cnn.py"), "--dtype", "bfloat16", "--format", "json").json()
    assert doc["dtype"] == "bfloat16"


def test_model_prints_do_not_corrupt_json(cli, tmp_path):
    path = tmp_path / "noisy.py"
    path.write_text("import torch\nfrom torch import nn\n\nprint('building')\n\n"
                    "class Net(nn.Module):\n    def forward(self, x):\n        print('forward')\n"
                    "        return x * 2\n\n\ndef example_inputs():\n    return (torch.ones(2),)\n")
    # print() at the top level is a call: --exec imports it anyway.
    result = cli("check", path, "--exec", "--format", "json")
    assert result.json()["target"]["entry"] == "Net()"
    assert "building" in result.err


def test_not_imported_script_reports_why(cli):
    result = cli("check", model("train_script.py"), "--format", "json")
    doc = result.json()
    assert doc["target"]["trace"] == "none" and doc["nodes"] == []
    # Not imported (AMP003), but its source is still linted: a GradScaler next to bf16 autocast.
    assert [(f["rule"], f["line"], f["column"]) for f in doc["findings"]] == [("AMP409", 24, 10), ("AMP003", 27, 1)]
    assert result.code == 1  # AMP409 is a warning
    assert "pass --exec" in doc["target"]["notes"][0]


def test_ops_command_shows_the_catalog_with_a_policy(cli, tmp_path):
    doc = cli("ops", "LayerNorm", "--format", "json").json()
    assert [(e["kind"], e["precision"], e["autocast"]) for e in doc] == [("layer_norm", "fp32", "fp32")]
    assert "torch.nn.LayerNorm" in doc[0]["also"] and "native_layer_norm" in doc[0]["also"]
    policy = tmp_path / "p.toml"
    policy.write_text('[ops.layer_norm]\nprecision = "fp16"\nreason = "our fused kernel"\n')
    (entry,) = cli("ops", "layer_norm", "--format", "json", "--policy", policy).json()
    assert (entry["precision"], entry["autocast"], entry["reason"]) == ("fp16", "fp32", "our fused kernel")
    result = cli("ops", "no-such-op")
    assert result.code == 2 and "no catalog entry matches 'no-such-op'" in result.err


def test_show_ops_lists_every_op(cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    out = cli("check", model("input_shape.py"), "--input-shape", "2,8", "--show-ops").out
    assert "Every op" in out
    for kind in ("placeholder", "linear", "relu", "output"):
        assert f" {kind} " in out


def test_slow_status_shows_only_after_its_delay_and_only_on_a_terminal(monkeypatch):
    import io
    import time

    from rich.console import Console

    import ampaudit.core.console as console_module

    screens: list[io.StringIO] = []

    def fake_terminal(file=None, **_):
        screens.append(io.StringIO())
        return Console(file=screens[-1], force_terminal=True, width=60)

    monkeypatch.setattr(console_module, "make_console", fake_terminal)
    with console_module.slow_status("converting", after=30):
        time.sleep(0.05)
    assert "converting" not in screens[-1].getvalue()  # quick: nothing shown
    with console_module.slow_status("converting", after=0.01):
        time.sleep(0.3)
    assert "converting" in screens[-1].getvalue()
    monkeypatch.setattr(console_module, "make_console", lambda file=None, **_: Console(file=io.StringIO()))
    with console_module.slow_status("converting", after=0):  # not a terminal: never started
        time.sleep(0.05)
