"""Pillar 2, ``ampaudit convert``: rewrite a model into explicit mixed precision, with fp32
master weights and loss scaling in the returned optimizer.

``ampaudit.convert`` is both this package and the API function (see ampaudit.check for why).
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from ampaudit.convert.api import convert

        return convert(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
