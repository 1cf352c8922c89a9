"""Writing files without ever losing what the user had.

Every write goes to a temporary file in the target's folder and is renamed over it, so no
reader sees half a file. A symlink is written through: the file it points to is replaced and
the link stays a link. A read-only file is refused, not overwritten. A rewrite of a file the
tool read first (``--fix``) is compare-and-swap: under an advisory lock, the file must still
hold exactly what was read, or nothing is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ampaudit.core.errors import UsageError

try:  # POSIX advisory locks; elsewhere the compare-and-swap alone guards the write
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _read(path: Path, encoding: str) -> str | None:
    try:
        with open(path, encoding=encoding, newline="") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (another ``--fix`` on it waits)."""
    try:
        fh = open(path, "rb") if fcntl is not None else None  # noqa: SIM115 - closed below
    except OSError:  # missing or unreadable: the read that follows says so, in one line
        fh = None
    if fh is None:
        yield
        return
    with fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def write_atomic(path: Path, text: str, *, expected: str | None = None, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename.

    The text is written as is (no newline translation); an existing file keeps its
    permission bits, a new one gets the umask's. ``expected``: the content ``path`` must still
    hold right before the rename (compare-and-swap); otherwise nothing is written and a
    UsageError says the file changed. ``encoding``: the file's own (a fixed latin-1 file with
    its coding cookie stays latin-1; ``utf-8-sig`` keeps a BOM).
    """
    path = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)  # write through a link
    if path.is_dir():
        raise UsageError(f"cannot write {path}: it is a folder")
    existing = path.exists()
    if existing and not os.access(path, os.W_OK):
        if path.stat().st_mode & 0o222:  # its mode allows writing: a file attribute or the mount forbids it
            raise UsageError(f"{path} cannot be written (immutable, or on a read-only file system): not rewritten")
        raise UsageError(f"{path} is read-only: not rewritten (make it writable to allow it)")
    folder = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding=encoding, newline="") as fh:
            fh.write(text)
        mode = stat.S_IMODE(os.stat(path).st_mode) if existing else 0o666 & ~_umask()
        os.chmod(tmp, mode)
        if expected is not None and _read(path, encoding) != expected:
            raise UsageError(f"{path} changed since ampaudit read it: nothing written (run the command again)")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (through links, relative parts, hard links)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)
