"""What each rule's fixtures give, computed once per test session.

tests/test_rules.py checks the `# expect:` lines and tests/test_rule_goldens.py the golden files
from the same cached findings, so the goldens cost no second audit. Both import this module as
`tests.rule_outputs` (pytest imports test files under another name: a cache kept in one of them
would not be shared).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from ampaudit.check.api import check_path
from ampaudit.check.fix import fixable
from ampaudit.check.lint import edits
from ampaudit.check.options import CheckOptions
from ampaudit.check.run import check_targets
from ampaudit.core.config import Config
from ampaudit.core.findings import Finding
from ampaudit.core.python_source import read_python
from ampaudit.watch.summary import read_log
from ampaudit.watch.verdicts import RUNTIME_RULES
from tests.conftest import ROOT, RULE_FIXTURES

WATCH_FIXTURES = ROOT / "fixtures" / "watch"  # CODE_invalid.jsonl, CODE_valid.jsonl: fixtures/watch/record.py


def fixture(code: str, kind: str) -> Path:
    """A rule's `invalid` or `valid` fixture: a script or model, or for AMP6xx a watch log."""
    if code in RUNTIME_RULES:
        return WATCH_FIXTURES / f"{code}_{kind}.jsonl"
    return RULE_FIXTURES / f"{code}_{kind}.py"


@contextmanager
def without_torch():
    """`import torch` fails as where torch is not installed (tests/test_no_torch.py blocks it for real)."""
    saved = sys.modules.get("torch")
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.modules["torch"] = saved


# fp8 verdicts that only some recipes give: their fixtures are checked under one of them
FP8_FIXTURE_RECIPES = {"AMP707": "mxfp8", "AMP708": "rowwise"}


def compute_findings(code: str, kind: str) -> tuple[Finding, ...]:
    """What `ampaudit check --select CODE` reports on the fixture - for AMP6xx, the log's
    findings of that code (`ampaudit report`). Run from the repository root: paths are relative."""
    path = fixture(code, kind)
    if code in RUNTIME_RULES:
        return tuple(Finding.from_dict(f) for f in read_log(path).summary()["findings"] if f["rule"] == code)
    config = Config(select=[code], fail_on="never")
    target = str(path.relative_to(ROOT))
    if code == "AMP004":  # syntax errors are findings when a folder is checked
        report = check_targets([target, "fixtures/models/clean_cnn.py"], config, CheckOptions())
    elif code in FP8_FIXTURE_RECIPES:  # a verdict of one recipe: `--fp8-recipe RECIPE`
        report = check_targets([target], config, CheckOptions(dtype="fp8", fp8_recipe=FP8_FIXTURE_RECIPES[code]))
    elif code.startswith("AMP7"):  # the fp8 audit: `ampaudit check --dtype fp8` (tensorwise)
        report = check_path(target, config=config, dtype="fp8")
    elif code == "AMP006":  # a model file checked without torch
        with without_torch():
            report = check_path(target, config=config)
    else:
        report = check_path(target, config=config)
    return tuple(report.findings)


findings = cache(compute_findings)  # findings are frozen: sharing them between tests is safe


# a syntax error names the grammar of the Python that read it: the goldens hold on any Python
_GRAMMAR = f"(Python {sys.version_info.major}.{sys.version_info.minor}'s grammar)"


def render(found: Iterable[Finding], code: str) -> str:
    """The golden text of findings on ``code``'s invalid fixture: one finding per line,
    `line:col CODE severity [fix|unsafe fix] message` (col `-` when there is none; the file
    is named, relative to the repository, only when it is not the fixture), then
    `  in module M` and `  fix: ...` when the finding has them - as the text report prints it."""
    here = fixture(code, "invalid").relative_to(ROOT).as_posix()
    lines = []
    for f in sorted(found, key=lambda f: (f.file, f.line, f.column or 0, f.rule, f.message)):
        file = Path(f.file)
        file = file.relative_to(ROOT) if file.is_absolute() and file.is_relative_to(ROOT) else file
        where = f"{f.line}:{'-' if f.column is None else f.column}"
        if file.as_posix() != here:
            where = f"{file.as_posix()}:{where}"
        fix = "" if f.autofix is None else "[fix] " if f.autofix.safe else "[unsafe fix] "
        message = f.message.replace(_GRAMMAR, "(Python X.Y's grammar)")
        lines.append(f"{where} {f.rule} {f.severity.value} {fix}{message}")
        if f.module:
            lines.append(f"  in module {f.module}")
        if f.fix:
            lines.append(f"  fix: {f.fix}")
    return "".join(f"{line}\n" for line in lines)


def fixed_source(code: str, found: Iterable[Finding]) -> str | None:
    """``code``'s invalid fixture after every autofix of ``found``, safe and unsafe alike - what
    `ampaudit check --select CODE --fix --unsafe-fixes` writes; None when nothing is fixable."""
    fixes = fixable(found, unsafe=True)
    if not fixes:
        return None
    before, _ = read_python(fixture(code, "invalid"))
    after, _ = edits.apply(before, (e for f in fixes for e in f.autofix.edits))
    return after
