"""AMP415: a custom torch.autograd.Function in code that uses autocast, without
torch.amp.custom_fwd / custom_bwd: its backward runs in whatever dtype forward happened to get."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.protocol import finding
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Finding

_FUNCTION_BASES = frozenset({"torch.autograd.Function", "torch.autograd.function.Function"})
_DECORATORS = {
    "forward": frozenset({"torch.amp.custom_fwd", "torch.cuda.amp.custom_fwd", "torch.amp.autocast_mode.custom_fwd"}),
    "backward": frozenset({"torch.amp.custom_bwd", "torch.cuda.amp.custom_bwd", "torch.amp.autocast_mode.custom_bwd"}),
}


@lint_rule("AMP415", reads=("Function", "custom_[fb]wd", "autocast"))
def autograd_function_without_custom_fwd(facts: ScriptFacts) -> Iterator[Finding]:
    if not facts.autocasts:
        return
    for cls in facts.classes:
        if not cls.bases & _FUNCTION_BASES:
            continue
        missing = [m for m, wanted in _DECORATORS.items()
                   if m in cls.decorated_methods and not cls.decorated_methods[m] & wanted]
        if missing:
            yield finding(facts, "AMP415", cls, name=cls.node.name, methods=" and ".join(missing),
                          fix='decorate forward with @torch.amp.custom_fwd(device_type="cuda") and backward with '
                              '@torch.amp.custom_bwd(device_type="cuda")')
