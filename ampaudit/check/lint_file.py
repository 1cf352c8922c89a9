"""Lint one file: parse once, collect facts in one visit, run every rule over them.

Reads the file with the standard library's ``ast`` and never imports torch, so linting (and
the pre-commit hook) stays fast.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ampaudit.check.lint.collect import collect
from ampaudit.check.script_rules import LINT_RULES, run_lint_rules
from ampaudit.core.errors import LoadError
from ampaudit.core.files import digest
from ampaudit.core.findings import Finding
from ampaudit.core.paths import display_path
from ampaudit.core.python_source import TOO_DEEP, read_python, run_deep, syntax_reason
from ampaudit.core.rulebook import rule


def lint_source(path: str, source: str) -> list[Finding]:
    """Findings for ``source``; a syntax error raises SyntaxError. Each fix
    remembers which text its offsets refer to, so it is never applied to another."""
    findings = run_lint_rules(collect(path, source, LINT_RULES.read_pattern()))
    if any(f.autofix is not None for f in findings):
        stamp = digest(source)
        findings = [replace(f, autofix=replace(f.autofix, source=stamp)) if f.autofix else f for f in findings]
    return findings


def read_text(path: Path) -> str:
    """The file's text as Python reads it: a PEP 263 coding cookie and a UTF-8 BOM are
    honoured (the BOM is dropped)."""
    return read_python(path)[0]


def lint_file(path: Path, *, syntax_errors_as_findings: bool = False) -> list[Finding]:
    """Lint a file. A file that cannot be linted (syntax error, unreadable, not text, nested
    too deeply) is a LoadError (exit 2) - or, when walking a folder, an AMP004 finding, so one
    bad file does not hide the rest."""
    try:
        source = read_text(path)
    except LoadError as exc:
        if not syntax_errors_as_findings:
            raise
        return [rule("AMP004").finding(display_path(str(path)), 1, reason=str(exc).replace(f"{path} ", ""))]
    try:
        return run_deep(lint_source, str(path), source)
    except SyntaxError as exc:  # Python's own parser: its line, column and reason
        line, column, reason = exc.lineno or 1, exc.offset or 1, syntax_reason(exc)
        if not syntax_errors_as_findings:
            raise LoadError(f"syntax error in {display_path(str(path))}:{line}:{column}: {reason}") from exc
        return [rule("AMP004").finding(display_path(str(path)), line, column=column, reason=f"syntax error: {reason}")]
    except RecursionError:
        if not syntax_errors_as_findings:
            raise LoadError(f"{display_path(str(path))}: {TOO_DEEP}") from None
        return [rule("AMP004").finding(display_path(str(path)), 1, reason=TOO_DEEP)]

