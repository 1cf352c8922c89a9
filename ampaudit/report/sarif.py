"""SARIF 2.1.0, as GitHub code scanning accepts it."""

from __future__ import annotations

import hashlib
import urllib.parse
from pathlib import Path
from typing import Any

from ampaudit.core.findings import Finding, Report, Severity
from ampaudit.core.rulebook import RuleInfo, rulebook

SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
INFORMATION_URI = "https://github.com/ampaudit/ampaudit"
_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}


def _rule_descriptor(rule: RuleInfo) -> dict[str, Any]:
    help_text = f"{rule.what}\n\nWhy: {rule.why}\n\nFix: {rule.fix}"
    help_md = (f"{rule.what}\n\n**Why it matters.** {rule.why}\n\n**Example**\n\n```python\n{rule.example}\n```"
               f"\n\n**Fix.** {rule.fix}")
    return {
        "id": rule.code,
        "name": "".join(part.capitalize() for part in rule.name.split("-")),
        "shortDescription": {"text": rule.what.split(". ")[0].rstrip(".") + "."},
        "fullDescription": {"text": rule.what},
        "help": {"text": help_text, "markdown": help_md},
        "defaultConfiguration": {"level": _LEVEL[rule.severity]},
        "properties": {"tags": ["mixed-precision", rule.family]},
    }


def _uri(file: str) -> tuple[str, str | None]:
    """A URI reference (RFC 3986, as SARIF requires): spaces, ``#``, ``%`` and the like
    percent-encoded; relative paths resolve against %SRCROOT%."""
    path = Path(file)
    if path.is_absolute():
        return path.as_uri(), None
    return urllib.parse.quote(path.as_posix(), safe="/"), "%SRCROOT%"


def _fingerprint(finding: Finding) -> str:
    key = f"{finding.rule}|{finding.file}|{finding.module}|{finding.message}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _result(finding: Finding, index: dict[str, int]) -> dict[str, Any]:
    uri, base = _uri(finding.file)
    artifact: dict[str, Any] = {"uri": uri}
    if base:
        artifact["uriBaseId"] = base
    region: dict[str, Any] = {"startLine": max(finding.line, 1)}
    if finding.column:
        region["startColumn"] = finding.column
    location: dict[str, Any] = {"physicalLocation": {"artifactLocation": artifact, "region": region}}
    if finding.module:
        location["logicalLocations"] = [{"fullyQualifiedName": finding.module, "kind": "module"}]
    result: dict[str, Any] = {
        "ruleId": finding.rule,
        "level": _LEVEL[finding.severity],
        "message": {"text": finding.message},
        "locations": [location],
        "partialFingerprints": {"ampauditFinding/v1": _fingerprint(finding)},
    }
    if finding.rule in index:
        result["ruleIndex"] = index[finding.rule]
    if finding.fix:
        result["properties"] = {"fix": finding.fix}
    return result


def to_sarif(report: Report) -> dict[str, Any]:
    rules = list(rulebook().values())
    index = {rule.code: i for i, rule in enumerate(rules)}
    return {
        "$schema": SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {
                "name": "ampaudit",
                "version": report.version,
                "informationUri": INFORMATION_URI,
                "rules": [_rule_descriptor(rule) for rule in rules],
            }},
            "originalUriBaseIds": {"%SRCROOT%": {"uri": Path.cwd().as_uri() + "/"}},
            "results": [_result(f, index) for f in report.findings],
            "properties": {"dtype": report.dtype.name, "target": report.target.to_dict()},
        }],
    }
