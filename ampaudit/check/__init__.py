"""Pillar 1, ``ampaudit check``: audit a model before enabling AMP.

``ampaudit.check`` is both this package and the API function: importing a subpackage makes
Python set it as an attribute of its parent, which would shadow a function of the same
name, so the package itself is callable and forwards to :func:`ampaudit.check.api.check`.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from ampaudit.check.api import check

        return check(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
