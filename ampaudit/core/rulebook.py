"""Rule metadata (rules/rules.toml): codes, severities, messages and documentation.

Code decides *where* a rule fires; this file decides what it is called, how severe it is
and what it tells the user - so those can change without touching any pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from ampaudit.core.findings import Autofix, Finding, Severity
from ampaudit.core.resources import load_toml, rules_dir

CODE_RE = re.compile(r"^AMP\d{3}$")
FAMILIES = {
    "AMP0": "loading and tracing",
    "AMP1": "op precision",
    "AMP2": "numeric hazards",
    "AMP3": "measured ranges",
    "AMP4": "training scripts",
    "AMP5": "conversion",  # reserved: convert reports a ConversionSummary, no findings yet
    "AMP6": "runtime",  # watch's verdicts, at the end of its summary (watch/runtime_rules.py)
    "AMP7": "fp8",  # check --dtype fp8: which Linears train in fp8 under a recipe (check/fp8_audit.py)
}


@dataclass(frozen=True)
class RuleInfo:
    """What rules.toml says of one code: its name, severity, message template and docs."""

    code: str
    name: str
    severity: Severity
    message: str
    what: str
    why: str
    example: str
    fix: str
    params: dict[str, Any] = field(default_factory=dict)  # thresholds, from [CODE.params]
    supersedes: tuple[str, ...] = ()  # codes this finding makes redundant on the same node
    hints: dict[str, str] = field(default_factory=dict)  # a finding's short fix, by case, from [CODE.hints]
    messages: dict[str, str] = field(default_factory=dict)  # other cases' messages, from [CODE.messages]

    @property
    def family(self) -> str:
        return FAMILIES.get(self.code[:4], "other")

    def format(self, case: str | None = None, **fields: Any) -> str:
        """The message with ``fields``; ``case``: one of ``[CODE.messages]`` instead of ``message``."""
        return (self.message if case is None else self.messages[case]).format(**fields)

    def finding(
        self,
        file: str,
        line: int,
        *,
        column: int | None = None,
        module: str | None = None,
        node: str | None = None,
        fix: str | None = None,
        autofix: Autofix | None = None,
        case: str | None = None,
        **fields: Any,
    ) -> Finding:
        return Finding(self.code, self.severity, self.format(case, **fields), file, line, column, module, node, fix,
                       autofix)


@cache
def rulebook() -> dict[str, RuleInfo]:
    table = load_toml(rules_dir() / "rules.toml")
    rules = {}
    for code, raw in table.items():
        if not CODE_RE.match(code):
            raise RuntimeError(f"rules.toml: {code!r} is not a rule code (AMP + 3 digits)")
        rules[code] = RuleInfo(
            code=code,
            name=raw["name"],
            severity=Severity.parse(raw["severity"]),
            message=raw["message"],
            what=raw["what"],
            why=raw["why"],
            example=raw["example"].strip("\n"),
            fix=raw["fix"],
            params=dict(raw.get("params", {})),
            supersedes=tuple(raw.get("supersedes", ())),
            hints=dict(raw.get("hints", {})),
            messages=dict(raw.get("messages", {})),
        )
    return dict(sorted(rules.items()))


def rule(code: str) -> RuleInfo:
    return rulebook()[code]
