"""Every rule: a stable code, a message, docs, VALID and INVALID fixtures pinned to exact lines -
for the runtime rules (AMP6xx, AMP75x), watch logs of real runs that do and do not produce them."""

from __future__ import annotations

import json

import pytest

from ampaudit.core.rulebook import CODE_RE, rulebook
from ampaudit.report.rule_docs import rules_markdown
from ampaudit.watch.verdicts import RUNTIME_RULES
from tests.conftest import ROOT, RULE_FIXTURES, expected_markers
from tests.rule_outputs import WATCH_FIXTURES, findings

RULES = sorted(rulebook())
CHECK_RULES = [code for code in RULES if code not in RUNTIME_RULES]  # fixtures/rules/CODE_*.py


def _found(code, kind):
    # cached: tests/test_rule_goldens.py compares the same findings with the golden files
    return [(f.line, f.rule) for f in findings(code, kind)]


@pytest.mark.parametrize("code", RULES)
def test_rule_is_documented(code):
    rule = rulebook()[code]
    assert CODE_RE.match(code)
    assert rule.name == rule.name.lower() and " " not in rule.name
    for field in ("message", "what", "why", "example", "fix"):
        assert getattr(rule, field).strip(), f"{code} has no {field}"


@pytest.mark.parametrize("code", CHECK_RULES)
def test_invalid_fixture_fires_on_the_marked_lines(code):
    path = RULE_FIXTURES / f"{code}_invalid.py"
    expected = [m for m in expected_markers(path) if m[1] == code]
    assert expected, f"{path.name} marks no line with `# expect: {code}`"
    assert _found(code, "invalid") == expected


@pytest.mark.parametrize("code", CHECK_RULES)
def test_valid_fixture_is_clean(code):
    path = RULE_FIXTURES / f"{code}_valid.py"
    assert not expected_markers(path)
    assert _found(code, "valid") == []


def _watch_fixture(code: str, kind: str) -> tuple[list, list]:
    """A runtime rule's log: what its header expects ([code, module]) and what it gives."""
    path = WATCH_FIXTURES / f"{code}_{kind}.jsonl"
    expect = json.loads(path.read_text().splitlines()[0])["expect"]
    found = [[f.rule, f.module] for f in findings(code, kind)]  # only those of code
    return expect, found


@pytest.mark.parametrize("code", RUNTIME_RULES)
def test_runtime_invalid_fixture_gives_the_expected_findings(code):
    expect, found = _watch_fixture(code, "invalid")
    assert expect and all(rule == code for rule, _ in expect)
    assert found == expect


@pytest.mark.parametrize("code", RUNTIME_RULES)
def test_runtime_valid_fixture_is_clean(code):
    assert _watch_fixture(code, "valid") == ([], [])


def test_every_fixture_belongs_to_a_rule():
    stems = {p.stem.rsplit("_", 1)[0] for p in RULE_FIXTURES.glob("AMP*valid.py")}  # not the goldens' .fixed.py
    assert stems == set(CHECK_RULES)
    logs = {p.stem.rsplit("_", 1)[0] for p in WATCH_FIXTURES.glob("AMP*.jsonl")}
    assert logs == set(RUNTIME_RULES)


def test_codes_are_unique_and_names_too():
    names = [r.name for r in rulebook().values()]
    assert len(names) == len(set(names))


def test_docs_rules_md_is_generated_from_rules_toml():
    # docs/rules.md is committed for browsing; regenerate with `ampaudit rules --format markdown`.
    assert (ROOT / "docs" / "rules.md").read_text() == rules_markdown(rulebook().values())


def test_rules_and_explain_commands(cli):
    result = cli("rules", "--format", "json")
    assert [r["code"] for r in result.json()] == RULES
    result = cli("explain", "amp101")
    assert result.code == 0
    assert result.out.startswith("# AMP101 `fp32-op-left-in-low-precision` (info)")
    assert "**Why it matters.**" in result.out and "```python" in result.out
    result = cli("explain", "AMP999")
    assert result.code == 2 and "unknown rule 'AMP999'" in result.err


def test_every_rule_is_implemented_once_and_documented():
    from ampaudit.check.graph_rules import GRAPH_RULES
    from ampaudit.check.script_rules import LINT_RULES
    from ampaudit.graph.fp8_verdicts import FP8_CODES

    graph, lint, runtime = set(GRAPH_RULES.load()), set(LINT_RULES.load()), set(RUNTIME_RULES)
    fp8 = set(FP8_CODES)  # check --dtype fp8 (graph/fp8_verdicts.py)
    assert not graph & lint and not (graph | lint) & runtime and not (graph | lint | runtime) & fp8
    assert graph | lint | runtime | fp8 <= set(rulebook())
    # watch's runtime rules (watch/runtime_rules.py): AMP6xx, and AMP75x over fp8=True's float8 rows
    assert all(code.startswith(("AMP6", "AMP75")) for code in runtime)
    # The rest are reported by the pipeline itself: trace coverage and syntax errors.
    rest = set(rulebook()) - graph - lint - runtime - fp8
    assert rest == {"AMP001", "AMP002", "AMP003", "AMP004", "AMP005", "AMP006"}
