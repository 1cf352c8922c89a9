"""Import a user's file the way ``python file.py`` would, without changing what ampaudit imports later.

While the file imports, its folder (and its package's root) come first on ``sys.path``, so it
finds its siblings. Afterwards those folders move to the end of ``sys.path`` - a sibling that
the model imports lazily in ``forward`` is still found, but never ahead of the standard library
or an installed package - and every module the import loaded from them whose name belongs to
another module (a sibling ``rich.py``, ``html.py``, ``decimal.py``) leaves ``sys.modules``, so
ampaudit's own later ``import rich`` gets the real one. The user's objects keep their references.
"""

from __future__ import annotations

import importlib.machinery
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

_OWN = __name__.partition(".")[0]  # ampaudit itself, when the user's folder is its checkout


@contextmanager
def user_folders(folders: Sequence[Path]) -> Iterator[None]:
    before_path = list(sys.path)
    before_modules = set(sys.modules)
    added = [str(f) for f in folders if str(f) not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        sys.path[:] = before_path + [f for f in added if f not in before_path]
        for name in set(sys.modules) - before_modules:
            top = name.partition(".")[0]
            if top != _OWN and _loaded_from(sys.modules.get(name), folders) and shadows(top, folders):
                del sys.modules[name]


def shadows(name: str, excluding: Sequence[Path] = ()) -> bool:
    """Whether ``name`` is also a standard-library or installed module: found on ``sys.path``
    outside the user's own ``excluding`` folders."""
    if name in sys.builtin_module_names or name in sys.stdlib_module_names:
        return True
    skip = {str(Path(f).resolve()) for f in excluding}
    path = [entry for entry in sys.path if str(Path(entry or ".").resolve()) not in skip]
    try:
        return importlib.machinery.PathFinder.find_spec(name, path) is not None
    except (ImportError, ValueError):
        return False


def _loaded_from(module: object, folders: Sequence[Path]) -> bool:
    file = getattr(module, "__file__", None)
    return bool(file) and any(Path(file).resolve().is_relative_to(folder) for folder in folders)
