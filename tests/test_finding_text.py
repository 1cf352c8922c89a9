"""The text report prints a finding made alike in many modules - one source line of a block
the model repeats (minGPT's tanh GELU `torch.pow(x, 3.0)` in every layer) - once, naming the
modules; the machine formats keep one finding per module."""

from __future__ import annotations

from io import StringIO

from rich.console import Console

from ampaudit.core.finding_text import MODULES_SHOWN, render_findings
from ampaudit.core.findings import Finding, Severity


def _render(findings: list[Finding]) -> str:
    out = StringIO()
    render_findings(findings, Console(file=out, width=200, color_system=None))
    return out.getvalue()


def _pow(module: str, line: int = 27) -> Finding:
    return Finding("AMP206", Severity.WARNING, "x ** 3 overflows float16 once |x| > 40.3", "model.py", line, 87,
                   module=module, fix="compute the power on an fp32 copy")


def test_the_same_finding_in_many_modules_prints_once_naming_them():
    findings = [_pow(f"h.{i}.mlp.act") for i in range(3)] + [_pow("head", line=40)]
    text = _render(findings)
    assert text.count("AMP206 [warning]") == 2
    assert "in 3 modules: h.0.mlp.act, h.1.mlp.act, h.2.mlp.act" in text
    assert "in module head" in text
    assert "Found 0 errors, 4 warnings, 0 infos." in text  # every finding still counts


def test_a_long_list_of_modules_is_cut_and_counted():
    text = _render([_pow(f"layers.{i}.act") for i in range(24)])
    assert text.count("AMP206 [warning]") == 1
    shown = ", ".join(f"layers.{i}.act" for i in range(MODULES_SHOWN))
    assert f"in 24 modules: {shown} and {24 - MODULES_SHOWN} more" in text


def test_findings_differing_in_words_or_without_a_module_stay_apart():
    other = Finding("AMP206", Severity.WARNING, "x ** 4 overflows float16 once |x| > 16", "model.py", 27, 87,
                    module="h.1.mlp.act")
    lint = [Finding("AMP401", Severity.WARNING, "deprecated", "train.py", 3) for _ in range(2)]
    text = _render([_pow("h.0.mlp.act"), other, *lint])
    assert text.count("AMP206 [warning]") == 2 and text.count("AMP401 [warning]") == 2


def test_a_snippet_is_decoded_in_the_file_s_own_encoding(tmp_path, cli):
    # a latin-1 file (PEP 263 cookie): its é, not U+FFFD; its byte 0x85 (U+0085 in latin-1)
    # and a form feed break no line, as for Python, so the snippet shows the finding's line
    script = tmp_path / "latin.py"
    script.write_bytes(b'# -*- coding: latin-1 -*-\n\x0c\nimport torch\ns = "\xe9\x85"\n'
                       b'with torch.cuda.amp.autocast():\n    pass\n')
    out = cli("check", str(script), "--lint-only").out
    assert "\ufffd" not in out
    assert '  4 | s = "é' in out and "> 5 | with torch.cuda.amp.autocast():" in out


def test_an_inline_suppression_is_read_on_the_line_python_numbers(tmp_path, cli):
    script = tmp_path / "train.py"
    script.write_bytes(b"import torch\n\x0c\nwith torch.cuda.amp.autocast():  # ampaudit: ignore[AMP401]\n    pass\n")
    assert cli("check", str(script), "--lint-only").code == 0
