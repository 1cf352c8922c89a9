"""Offline wheels of what is already installed: a folder that ``pip install --no-index
--find-links`` installs ampaudit's lint-only dependencies (or hatchling, to build it) from.

A pure-Python distribution installed here is zipped back into a wheel from its own RECORD (the
files it installed, less the scripts pip generates and the installer's bookkeeping); one that
is not installed, or not pure, is asked of the registry with ``pip download`` (CI has one).
Used by tests/test_lint_install.py and bench/install_size.py.
"""

from __future__ import annotations

import base64
import email.parser
import hashlib
import importlib.metadata
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

INSTALLER_FILES = {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json"}


class Unavailable(RuntimeError):
    """A distribution is neither installed as pure Python nor downloadable here."""


def requirements_of(requires: list[str] | None) -> list[Requirement]:
    """``Requires-Dist`` entries whose markers hold on this interpreter, extras off."""
    out = []
    for text in requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req)
    return out


def repack(dist: importlib.metadata.Distribution, out: Path) -> Path | None:
    """Zip an installed pure-Python distribution back into a wheel in ``out``; None when it is
    not pure Python (or its files are not listed)."""
    wheel_info = dist.read_text("WHEEL") or ""
    fields = [line.partition(":")[::2] for line in wheel_info.splitlines()]
    tags = [value.strip() for key, value in fields if key.strip() == "Tag"]
    pure = any(key.strip() == "Root-Is-Purelib" and value.strip() == "true" for key, value in fields)
    files = dist.files
    if not pure or not tags or not files:
        return None
    info = next(f for f in files if f.name == "METADATA" and f.parent.name.endswith(".dist-info"))
    stem = info.parent.name.removesuffix(".dist-info")
    wheel = out / f"{stem}-{tags[0]}.whl"
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in files:
            path = f.as_posix()
            if path.startswith("..") or "__pycache__" in f.parts or path.endswith(".pyc") or (
                    f.parent == info.parent and f.name in INSTALLER_FILES):
                continue
            data = Path(f.locate()).read_bytes()
            zf.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{path},sha256={digest},{len(data)}")
        record.append(f"{info.parent.as_posix()}/RECORD,,")
        zf.writestr(f"{info.parent.as_posix()}/RECORD", "\n".join(record) + "\n")
    return wheel


def _download(name: str, out: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary",
                           ":all:", "-d", str(out), name], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise Unavailable(f"{name} is not installed as pure Python and `pip download` failed: "
                          f"{proc.stderr.strip().splitlines()[-1:] or proc.returncode}")


def fill(out: Path, requires: list[str]) -> list[str]:
    """Put a wheel of every distribution ``requires`` needs, recursively, into ``out``; returns
    their names. Raises Unavailable when one cannot be had."""
    seen: dict[str, None] = {}
    todo = requirements_of(requires)
    while todo:
        req = todo.pop()
        key = req.name.lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = None
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            _download(str(req), out)
            continue  # its own dependencies: pip download --no-deps does not say; rare enough
        if repack(dist, out) is None:
            _download(f"{req.name}=={dist.version}", out)
        todo += requirements_of(dist.requires)
    return list(seen)


def wheel_requires(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a built wheel."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(zf.read(name).decode()).get_all("Requires-Dist") or []
