"""ampaudit: precision auditing for PyTorch mixed-precision training.

Importing ampaudit is cheap: torch is imported only when an API that needs it is used, and
without torch (``pip install ampaudit`` alone) those APIs raise ``TorchMissing``, an
ImportError naming ``pip install "ampaudit[torch]"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ampaudit._version import __version__

if TYPE_CHECKING:
    from ampaudit.check.api import check
    from ampaudit.convert.api import convert
    from ampaudit.convert.apply import apply
    from ampaudit.convert.emit import autocast_policy
    from ampaudit.convert.fp8 import fp8_policy
    from ampaudit.core.findings import Finding, NodeDecision, Report
    from ampaudit.watch.monitor import watch
    from ampaudit.watch.step_guard import StepGuard
else:
    # Callable packages: ampaudit.check(model, ...) audits, ampaudit.convert(model, ...) converts,
    # ampaudit.watch(model, ...) monitors training.
    from ampaudit import check, convert, watch

__all__ = ["Finding", "NodeDecision", "Report", "StepGuard", "__version__", "apply", "autocast_policy", "check",
           "convert", "fp8_policy", "watch"]

_LAZY = {
    "apply": ("ampaudit.convert.apply", "apply"),
    "autocast_policy": ("ampaudit.convert.emit", "autocast_policy"),
    "fp8_policy": ("ampaudit.convert.fp8", "fp8_policy"),
    "Report": ("ampaudit.core.findings", "Report"),
    "Finding": ("ampaudit.core.findings", "Finding"),
    "NodeDecision": ("ampaudit.core.findings", "NodeDecision"),
    "StepGuard": ("ampaudit.watch.step_guard", "StepGuard"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from ampaudit.core.torch_extra import import_needing_torch

        module, attr = _LAZY[name]
        return getattr(import_needing_torch(module, f"ampaudit.{name}"), attr)
    raise AttributeError(f"module 'ampaudit' has no attribute {name!r}")
