"""Packages that are also functions: ``ampaudit.check(model)``, ``ampaudit.convert(...)``,
``ampaudit.watch(...)``.

Importing a subpackage makes Python set it as an attribute of its parent, which would
shadow a function of the same name in ``ampaudit/__init__.py``; so the package module
itself is made callable and forwards to the API function, imported on the first call (which
keeps ``import ampaudit`` free of torch).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


def make_callable(package: str, module: str, function: str) -> None:
    """Make the already-imported ``package`` call ``module.function`` when called."""

    class _CallablePackage(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(importlib.import_module(module), function)(*args, **kwargs)

    sys.modules[package].__class__ = _CallablePackage
