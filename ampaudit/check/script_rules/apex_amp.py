"""AMP402: NVIDIA apex.amp - unmaintained; native torch.amp does the same job."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.protocol import finding
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Finding


def _is_apex_amp(module: str, names: tuple[tuple[str, str], ...]) -> bool:
    if module == "apex.amp" or module.startswith("apex.amp."):
        return True
    return module == "apex" and any(name == "amp" for name, _ in names)


@lint_rule("AMP402", reads=("apex", r"\bamp\b"))
def apex_amp(facts: ScriptFacts) -> Iterator[Finding]:
    for imp in facts.imports:
        if _is_apex_amp(imp.module, imp.names):
            yield finding(facts, "AMP402", imp, use=f"import of {imp.module}",
                          fix="torch.amp.autocast + torch.amp.GradScaler")
    for call in facts.calls:
        name = next((n for n in call.names if n.startswith("apex.amp.")), None)
        if name is not None:
            yield finding(facts, "AMP402", call, use=f"{name}()", fix="torch.amp.autocast + torch.amp.GradScaler")
