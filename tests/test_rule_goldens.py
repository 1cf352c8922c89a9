"""Golden files per rule: the exact output on each rule's invalid fixture, not only its lines.

tests/test_rules.py pins (line, code) with the `# expect:` markers; here a reworded message,
a moved column, a changed fix hint or a changed autofix fail too - only the test of that rule.

- `fixtures/rules/AMPnnn_invalid.expected` (AMP6xx: `fixtures/watch/AMPnnn_invalid.expected`):
  what `ampaudit check --select AMPnnn` reports on the fixture (AMP6xx: `ampaudit report` on
  the log, that code's findings), one finding per line in the text report's order:
  `line:col CODE severity [fix|unsafe fix] message` (col `-` when none; a finding in another
  file than the fixture starts with that file, relative to the repository), followed by
  `  in module M` and `  fix: ...` lines when the finding has them.
- `fixtures/rules/AMPnnn_invalid.fixed.py`, for each rule whose findings carry an autofix: the
  fixture after applying all of them, safe and unsafe alike - what
  `ampaudit check --select AMPnnn --fix --unsafe-fixes` writes (the safe/unsafe split is in the
  `.expected` file). The fixed file must leave nothing of that rule to fix: fixing is idempotent.

To regenerate after an intended change, then review the diff of the goldens:

    python -m pytest tests/test_rule_goldens.py --update-goldens
    AMPAUDIT_UPDATE_GOLDENS=1 python -m pytest tests/test_rule_goldens.py   # the same

The findings are the ones tests/test_rules.py computes (tests/rule_outputs.py caches them), so
these tests add no audit of their own except the one pass that proves a message is seen by
exactly one golden.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import warnings
from pathlib import Path

import pytest

from ampaudit.check.lint_file import lint_source
from ampaudit.core.rulebook import rulebook
from tests.conftest import ROOT, RULE_FIXTURES
from tests.rule_outputs import WATCH_FIXTURES, compute_findings, findings, fixed_source, fixture, render

GOLDEN_RULES = [code for code in rulebook() if fixture(code, "invalid").exists()]
FIXED_SUFFIX = "_invalid.fixed.py"
FIXED_RULES = sorted(p.name.removesuffix(FIXED_SUFFIX) for p in RULE_FIXTURES.glob(f"AMP*{FIXED_SUFFIX}"))
HOW_TO_UPDATE = ("If the change is intended: python -m pytest tests/test_rule_goldens.py --update-goldens "
                 "(or AMPAUDIT_UPDATE_GOLDENS=1), then review the goldens' diff.")


class GoldenUpdated(UserWarning):
    """A golden file was rewritten: the test passes and says so in pytest's warnings summary."""


def _expected_path(code: str) -> Path:
    return fixture(code, "invalid").with_suffix(".expected")


def _fixed_path(code: str) -> Path:
    return RULE_FIXTURES / f"{code}{FIXED_SUFFIX}"


@pytest.fixture
def update(request) -> bool:
    # default=False: the option lives in tests/conftest.py; the env var works with any selection
    return bool(request.config.getoption("--update-goldens", default=False)) or \
        os.environ.get("AMPAUDIT_UPDATE_GOLDENS", "") not in ("", "0")


def _compare(path: Path, actual: str, update: bool) -> None:
    name = path.relative_to(ROOT).as_posix()
    expected = path.read_text(encoding="utf-8") if path.exists() else None
    if expected == actual:
        return
    if update:
        path.write_text(actual, encoding="utf-8", newline="")  # byte for byte what the rule gives
        warnings.warn(GoldenUpdated(f"{'rewrote' if expected is not None else 'created'} {name}"), stacklevel=2)
        return
    if expected is None:
        pytest.fail(f"{name} does not exist. {HOW_TO_UPDATE}", pytrace=False)
    diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True), actual.splitlines(keepends=True),
                                        f"{name} (golden)", f"{name} (now)"))
    pytest.fail(f"{name} differs from what the rule gives now:\n{diff}\n{HOW_TO_UPDATE}", pytrace=False)


@pytest.mark.parametrize("code", GOLDEN_RULES)
def test_findings_match_the_golden(code, update):
    _compare(_expected_path(code), render(findings(code, "invalid"), code), update)


@pytest.mark.parametrize("code", FIXED_RULES)
def test_fixed_file_matches_the_golden(code, update):
    fixed = fixed_source(code, findings(code, "invalid"))
    if fixed is None:  # the rule's autofix went away: its golden is orphaned
        if update:
            _fixed_path(code).unlink()
            warnings.warn(GoldenUpdated(f"removed {_fixed_path(code).name}: {code} has no autofix"), stacklevel=1)
            return
        pytest.fail(f"{code} has no autofix any more: delete {_fixed_path(code).name}. {HOW_TO_UPDATE}",
                    pytrace=False)
    _compare(_fixed_path(code), fixed, update)
    compile(fixed, _fixed_path(code).name, "exec")
    # A second --fix changes nothing: no finding of this rule is left with an autofix.
    left = [(f.line, f.message) for f in lint_source(str(fixture(code, "invalid")), fixed)
            if f.rule == code and f.autofix is not None]
    assert left == [], f"{code}: fixing the fixed file again would change it"


def test_every_rule_with_an_invalid_fixture_has_its_goldens_and_none_is_orphaned(update):
    # GOLDEN_RULES comes from rules.toml and the fixtures: a golden without both is orphaned
    expected = {_expected_path(code).name for code in GOLDEN_RULES}
    found = {p.name for folder in (RULE_FIXTURES, WATCH_FIXTURES) for p in folder.glob("*.expected")}
    assert found == expected, f"missing: {sorted(expected - found)}, orphaned: {sorted(found - expected)}"
    fixable = {code for code in GOLDEN_RULES if fixed_source(code, findings(code, "invalid")) is not None}
    missing = sorted(fixable - set(FIXED_RULES))
    if update:  # a new fixable rule: the parametrized test only knows the fixed files that exist
        for code in missing:
            _compare(_fixed_path(code), fixed_source(code, findings(code, "invalid")), update)
        missing = []
    assert missing == [], f"fixable rules without {FIXED_SUFFIX}: {missing}. {HOW_TO_UPDATE}"
    assert set(FIXED_RULES) <= set(GOLDEN_RULES), f"orphaned: {sorted(set(FIXED_RULES) - set(GOLDEN_RULES))}"


_MARK = re.compile(r"<<(AMP\d{3})>> ")


def test_changing_one_message_fails_exactly_that_rules_golden(monkeypatch):
    """Rewording rule X's message in rules.toml fails X's golden and no other. One extra audit
    pass proves it for every X at once: every message gets a marker `<<CODE>> `; the output
    with only X's markers left is the output when X's message alone has changed."""
    now = {code: render(findings(code, "invalid"), code) for code in GOLDEN_RULES}  # before the patch: cached
    book = rulebook()
    for code, info in list(book.items()):
        monkeypatch.setitem(book, code, dataclasses.replace(info, message=f"<<{code}>> {info.message}"))
    marked = {code: render(compute_findings(code, "invalid"), code) for code in GOLDEN_RULES}

    def failing(changed: str) -> list[str]:
        return [code for code in GOLDEN_RULES
                if _MARK.sub(lambda m: m[0] if m[1] == changed else "", marked[code]) != now[code]]

    assert {code: failing(code) for code in GOLDEN_RULES} == {code: [code] for code in GOLDEN_RULES}
