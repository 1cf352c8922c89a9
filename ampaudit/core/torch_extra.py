"""torch is an extra: ``pip install ampaudit`` brings only what the lint needs (rich, and tomli
on old Pythons); ``pip install "ampaudit[torch]"`` adds torch and safetensors for check's model
audit, convert and watch.

The lint path - ``ampaudit check`` on files and folders, ``--help``, ``rules``, ``explain``,
``ops``, ``report`` - never imports torch (tests/test_no_torch.py runs it with torch made
unimportable). The commands and APIs that need torch ask this module first, so a missing
torch is one line naming the install command: exit 2 on the command line, a
:class:`TorchMissing` (an ``ImportError`` and an :class:`AmpauditError`) in Python.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType

from ampaudit.core.errors import AmpauditError

INSTALL = 'pip install "ampaudit[torch]"'
TORCH_EXTRA = ("torch", "safetensors")  # what the [torch] extra installs, by import name


class TorchMissing(AmpauditError, ImportError):
    """torch (or safetensors) is not installed, or cannot be imported: ``str(err)`` is one
    line naming what needed it and the install command; ``missing`` says which and why
    ("torch, which is not installed")."""

    def __init__(self, message: str, missing: str = "") -> None:
        super().__init__(message)
        self.missing = missing


def _unimportable(name: str) -> str | None:
    """Why ``import name`` fails here, as "NAME, which ..." (one line); None when it imports."""
    try:
        importlib.import_module(name)
    except ImportError as exc:
        if exc.name == name:
            return f"{name}, which is not installed"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"{name}, which cannot be imported ({first})"
    return None


def torch_missing(modules: Sequence[str] = ("torch",)) -> str | None:
    """Why the first of ``modules`` that does not import fails ("torch, which is not
    installed"), or None when all import - and are now in ``sys.modules``: call this only
    where torch would be imported next anyway."""
    for name in modules:
        why = _unimportable(name)
        if why is not None:
            return why
    return None


def require_torch(what: str, modules: Sequence[str] = ("torch",)) -> None:
    """Raise :class:`TorchMissing` unless every one of ``modules`` imports: ``what`` (``"ampaudit
    convert"``) names the feature in the message."""
    why = torch_missing(modules)
    if why is not None:
        raise TorchMissing(f"{what} needs {why}: {INSTALL}", why)


def require_installed(what: str, modules: Sequence[str] = ("torch",)) -> None:
    """As :func:`require_torch`, but without importing: only whether each module is installed
    (the command line's parent process, whose child process imports torch)."""
    import importlib.util

    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a finder that refuses it, a broken __spec__
            found = False
        if not found:
            why = f"{name}, which is not installed"
            raise TorchMissing(f"{what} needs {why}: {INSTALL}", why)


def import_needing_torch(module: str, what: str) -> ModuleType:
    """``importlib.import_module(module)``, where a missing torch or safetensors (anywhere in
    what the module imports) is a :class:`TorchMissing` naming ``what`` and the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = (exc.name or "").partition(".")[0]
        if top not in TORCH_EXTRA or isinstance(exc, TorchMissing):
            raise
        why = _unimportable(top) or f"{top}, which cannot be imported ({exc})"
        raise TorchMissing(f"{what} needs {why}: {INSTALL}", why) from exc
