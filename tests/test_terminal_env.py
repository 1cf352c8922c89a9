"""The report survives the terminal it is printed on (issue 25, item 6): a COLUMNS rich cannot
print in, an encoding without the report's characters, control bytes in file names, and a
bare `ampaudit`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ampaudit.core.console import make_console, printable

DEPRECATED = "import torch\nscaler = torch.cuda.amp.GradScaler()\n"


def _ampaudit(args, cwd, **env):
    return subprocess.run([sys.executable, "-m", "ampaudit", *args], cwd=cwd, capture_output=True, timeout=60,
                          env={**os.environ, **env})


@pytest.mark.parametrize("columns", ["0", "5", "wide", ""])
def test_a_columns_rich_cannot_print_in_is_ignored(columns, monkeypatch):
    monkeypatch.setenv("COLUMNS", columns)
    assert make_console().width == 120


def test_columns_zero_still_prints_the_report(tmp_path):
    (tmp_path / "t.py").write_text(DEPRECATED)
    done = _ampaudit(["check", "t.py", "--lint-only"], tmp_path, COLUMNS="0")
    assert done.returncode == 1 and b"t.py:2:10 AMP401" in done.stdout


def test_an_ascii_terminal_gets_the_report_with_replacements(tmp_path):
    (tmp_path / "t.py").write_text(DEPRECATED)
    done = _ampaudit(["check", "t.py", "--lint-only"], tmp_path, LC_ALL="C", PYTHONIOENCODING="ascii")
    assert done.returncode == 1, done.stderr
    assert b"t.py:2:10 AMP401" in done.stdout and b"Found 0 errors, 1 warnings" in done.stdout
    assert done.stderr == b""


def test_control_bytes_in_a_file_name_are_shown_escaped(tmp_path):
    name = "a\x1b[31mb\x07.py"
    (tmp_path / name).write_text(DEPRECATED + "# \x1b]0;title\x07\n")
    done = _ampaudit(["check", ".", "--lint-only"], tmp_path)
    assert b"\x1b" not in done.stdout and b"\x07" not in done.stdout
    assert b"a\\x1b[31mb\\x07.py:2:10 AMP401" in done.stdout
    assert printable("ok\tline") == "ok\tline" and printable("\x9b") == "\\x9b"


def test_bare_ampaudit_is_a_usage_error_with_help_on_stderr(tmp_path):
    done = _ampaudit([], tmp_path)
    assert done.returncode == 2 and done.stdout == b"" and b"usage: ampaudit" in done.stderr
