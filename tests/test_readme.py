"""README stays true: its set-up and test commands are the ones CI runs and they work."""

from __future__ import annotations

import re

from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()


def _blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def test_setup_is_two_commands_and_tests_one():
    setup, tests = _blocks()[:2]
    setup_cmds = [line.split("#")[0].strip() for line in setup.splitlines() if line.strip()]
    assert len(setup_cmds) == 2
    assert setup_cmds[0].startswith("pip install") and '-e ".[dev]"' in setup_cmds[0]
    assert setup_cmds[1].startswith("ampaudit check fixtures/")
    assert tests.strip() == "python -m pytest -q"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = _blocks()[1].strip()
    assert test_cmd in ci.splitlines()
    assert 'pip install --quiet --disable-pip-version-check "torch==2.13.0"' in ci


def test_main_job_runs_clean(cli):
    main_job = _blocks()[0].splitlines()[1].split("#")[0].split()
    assert main_job[0] == "ampaudit"
    result = cli(*main_job[1:])
    assert result.code == 0
    assert "No findings." in result.out
