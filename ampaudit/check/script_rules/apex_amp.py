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
    # One finding a file, at the first use, with the count: a trainer built on apex uses it
    # in a dozen places, and one migration fixes them all.
    uses: list[tuple[object, str]] = [(imp, f"import of {imp.module}") for imp in facts.imports
                                      if _is_apex_amp(imp.module, imp.names)]
    for call in facts.calls:
        name = next((n for n in call.names if n.startswith("apex.amp.")), None)
        if name is not None:
            uses.append((call, f"{name}()"))
    if not uses:
        return
    uses.sort(key=lambda u: (u[0].line, u[0].column))
    first, label = uses[0]
    more = f" and {len(uses) - 1} more use{'s' if len(uses) > 2 else ''} in this file" if len(uses) > 1 else ""
    yield finding(facts, "AMP402", first, use=label + more, fix="torch.amp.autocast + torch.amp.GradScaler")
