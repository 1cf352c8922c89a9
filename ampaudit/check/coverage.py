"""What the trace could not see: report notes plus AMP001 / AMP002 at the user's line."""

from __future__ import annotations

from ampaudit.core.findings import Finding
from ampaudit.core.paths import display_path
from ampaudit.core.rulebook import rule
from ampaudit.graph.trace import TraceResult


def coverage(trace: TraceResult, op_count: int) -> tuple[list[str], list[Finding]]:
    notes: list[str] = []
    findings: list[Finding] = []
    if trace.method == "fx":
        notes.append(f"traced with torch.fx: {op_count} ops, every branch")
    for failure in trace.failures:
        file, line, column = display_path(failure.loc.file), failure.loc.line, failure.loc.column
        where = f"{failure.module or 'the model'} ({failure.type_name}, {file}:{line})"
        if trace.method == "recorder":
            notes.append(
                f"torch.fx cannot trace {where}: {failure.message}; audited the {op_count} ops one forward "
                "executed on the example inputs - branches not taken are not audited"
            )
            findings.append(rule("AMP001").finding(file, line, column=column, module=failure.module or None,
                                                   reason=failure.message))
        else:
            notes.append(
                f"torch.fx cannot trace {where}: {failure.message}; kept it as one op and traced its "
                "children on their own - the ops in its forward are not audited (add example inputs)"
            )
            findings.append(rule("AMP002").finding(
                file, line, column=column, module=failure.module or None, reason=failure.message,
                module_label=failure.module or "the model",
            ))
    return notes, findings
