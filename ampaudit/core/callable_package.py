"""Packages that are also functions: ``ampaudit.check(model)``, ``ampaudit.convert(...)``,
``ampaudit.watch(...)``.

Importing a subpackage makes Python set it as an attribute of its parent, which would
shadow a function of the same name in ``ampaudit/__init__.py``; so the package module
itself is made callable and forwards to the API function, imported on the first call (which
keeps ``import ampaudit`` free of torch). Without torch, the call raises TorchMissing: one
line naming the install command.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from ampaudit.core.torch_extra import import_needing_torch


def make_callable(package: str, module: str, function: str) -> None:
    """Make the already-imported ``package`` call ``module.function`` when called."""

    class _CallablePackage(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(import_needing_torch(module, f"{package}()"), function)(*args, **kwargs)

    sys.modules[package].__class__ = _CallablePackage
