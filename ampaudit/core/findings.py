"""The findings model: what ``check`` reports and every output format renders.

A :class:`Finding` is one actionable message pinned to a user's source line; a
:class:`NodeDecision` is the precision verdict for one op of the model graph; a
:class:`Report` bundles both with the target description. ``Report.to_dict()`` *is* the
JSON document (docs/check.md: JSON schema). watch ends its summary dict with Findings too
(AMP6xx: runtime verdicts, pinned to the script that watched the run); convert reports a
ConversionSummary, and the AMP5xx family is reserved for when it reports through Findings.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ampaudit._version import __version__
from ampaudit.core.dtypes import FLOAT16, LowDtype


class Severity(str, enum.Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        return {"info": 0, "warning": 1, "error": 2}[self.value]

    @classmethod
    def parse(cls, text: str) -> Severity:
        try:
            return cls(text.lower())
        except ValueError:
            raise ValueError(f"unknown severity {text!r} (expected error, warning or info)") from None


FAIL_ON = ("error", "warning", "info", "never")  # the thresholds --fail-on and [tool.ampaudit] fail-on take


def fails_on(findings: Iterable[Finding], threshold: str) -> bool:
    """Whether any of ``findings`` is at least as severe as ``threshold`` (one of ``FAIL_ON``):
    what makes ``ampaudit check`` and ``ampaudit report`` exit 1. ``"never"``: none fails."""
    if threshold == "never":
        return False
    least = Severity.parse(threshold).rank
    return any(f.severity.rank >= least for f in findings)


class Precision(str, enum.Enum):
    """Where an op belongs in a mixed-precision model.

    LOW is written "fp16" in ops.toml, policies and the JSON report (a stable spelling); it
    means the audited low-precision dtype, float16 or bfloat16, which reports print."""

    LOW = "fp16"  # safe and profitable in the low-precision dtype (fp16 or bf16)
    FP32 = "fp32"  # needs fp32 for range or accuracy
    PROMOTE = "promote"  # runs in the widest dtype among its inputs
    NEUTRAL = "neutral"  # follows its input (shape ops, elementwise activations, ...)


@dataclass(frozen=True)
class Edit:
    """Replace ``text[start:end]`` (character offsets in the file) with ``replacement``."""

    start: int
    end: int
    replacement: str


@dataclass(frozen=True)
class Autofix:
    """Edits that resolve a finding. ``safe``: keeps the program's behaviour (``--fix``);
    otherwise it changes behaviour on purpose and needs ``--unsafe-fixes``."""

    edits: tuple[Edit, ...]
    safe: bool = True
    source: str | None = None  # sha256 of the text the edit offsets refer to (set by the lint)


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: Severity
    message: str
    file: str
    line: int
    column: int | None = None
    module: str | None = None
    node: str | None = None
    fix: str | None = None  # what to do, in words (the JSON "fix")
    autofix: Autofix | None = None  # machine-applicable edits, for --fix / --diff (not in the JSON)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "severity": self.severity.value,
            "message": self.message,
            "file": self.file,
            "line": self.line,
            "column": self.column,
            "module": self.module,
            "node": self.node,
            "fix": self.fix,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        """A finding from its ``to_dict()`` (a watch summary's "findings"); no autofix."""
        return cls(data["rule"], Severity.parse(data["severity"]), data["message"], data["file"], data["line"],
                   data.get("column"), data.get("module"), data.get("node"), data.get("fix"))


@dataclass
class NodeDecision:
    """One op of the audited graph and the precision it should run in."""

    name: str
    op: str  # fx opcode: call_function, call_module, call_method, placeholder, get_attr, output
    kind: str  # canonical op name ("linear", "layer_norm", ...), also for modules
    module: str | None
    precision: Precision
    reason: str
    file: str
    line: int
    rule: str | None = None  # code of the most severe finding attached to this node
    target: str = ""  # printable fx target, for humans only (not part of the JSON schema)
    measured: dict[str, Any] | None = None  # value ranges on the example inputs, when the model ran

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": self.op,
            "kind": self.kind,
            "module": self.module,
            "precision": self.precision.value,
            "reason": self.reason,
            "rule": self.rule,
            "file": self.file,
            "line": self.line,
            "measured": self.measured,
        }


@dataclass
class Target:
    file: str
    entry: str
    trace: str  # "fx", "fx-partial", "recorder" or "none"
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "entry": self.entry, "trace": self.trace, "notes": list(self.notes)}


@dataclass
class Report:
    target: Target
    dtype: LowDtype = FLOAT16
    nodes: list[NodeDecision] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    version: str = __version__
    fp8: dict[str, Any] | None = None  # `check --dtype fp8`: the recipe and each Linear's measurements and verdict

    def __post_init__(self) -> None:
        self.dtype = LowDtype.parse(self.dtype)  # "float16", "bf16" and torch dtypes are accepted

    def count(self, severity: Severity) -> int:
        return sum(f.severity is severity for f in self.findings)

    def fails(self, threshold: str) -> bool:
        """Whether a finding is at least as severe as ``threshold`` (see :func:`fails_on`)."""
        return fails_on(self.findings, threshold)

    def summary(self) -> dict[str, int]:
        return {
            "nodes": len(self.nodes),
            "fp32": sum(n.precision is Precision.FP32 for n in self.nodes),
            "fp16": sum(n.precision is Precision.LOW for n in self.nodes),  # low precision, as the schema spells it
            "errors": self.count(Severity.ERROR),
            "warnings": self.count(Severity.WARNING),
            "infos": self.count(Severity.INFO),
        }

    def sort(self) -> None:
        self.findings.sort(key=lambda f: (f.file, f.line, f.column or 0, f.rule))

    def to_dict(self) -> dict[str, Any]:
        return {
            "tool": "ampaudit",
            "version": self.version,
            "dtype": self.dtype.name,
            "target": self.target.to_dict(),
            "nodes": [n.to_dict() for n in self.nodes],
            "findings": [f.to_dict() for f in self.findings],
            "summary": self.summary(),
            **({"fp8": self.fp8} if self.fp8 is not None else {}),
        }
