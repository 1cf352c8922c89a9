"""Pillar 3, ``ampaudit watch``: runtime hooks that find where mixed-precision training goes
wrong - per-layer NaN/Inf/overflow/underflow counts, gradient magnitudes, the loss scale,
and the first module to go non-finite - at about one host sync per step.

``ampaudit.watch`` is both this package and the API function (see ampaudit.check for why).
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from ampaudit.watch.monitor import watch

        return watch(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
