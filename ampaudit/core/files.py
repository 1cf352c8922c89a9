"""Writing files without ever losing what the user had.

Every write goes to a temporary file in the target's folder and is renamed over it, so no
reader sees half a file. A symlink is written through when asked (``--fix``; outputs are
resolved by core/outputs.py first): the file it points to is replaced and the link stays a
link. A read-only file is refused, not overwritten; a rewritten file keeps its mode and owner.
A rewrite of a file the tool read first (``--fix``) is compare-and-swap: under an advisory
lock, the file must still hold exactly what was read, or nothing is written; and a file with
several hard links is refused, since a rename gives the new text to one of its names only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from ampaudit.core.errors import UsageError

try:  # POSIX advisory locks; elsewhere the compare-and-swap alone guards the write
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def umask() -> int:
    """The process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


LOCK_WAIT = 10.0  # seconds --fix waits for another process's lock on a file before giving up


@contextlib.contextmanager
def locked(path: Path, wait: float | None = None) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (another ``--fix`` on it waits, at most
    ``wait`` seconds, then a one-line UsageError)."""
    try:  # O_NONBLOCK: a file swapped for a FIFO must not block the open
        fh = os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") if fcntl is not None else None
    except OSError:  # missing or unreadable: the read that follows says so, in one line
        fh = None
    if fh is not None and not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
        fh.close()
        raise UsageError(f"{path} is no longer a regular file: not rewritten")
    if fh is None:
        yield
        return
    wait = LOCK_WAIT if wait is None else wait
    with fh:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise UsageError(f"{path} is locked by another process (another --fix?) for over {wait:g} s: "
                                     "not rewritten") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def write_atomic(path: Path, data: str | bytes, *, expected: str | None = None, encoding: str = "utf-8",
                 follow_links: bool = True, shown: str | None = None, folder_fd: int | None = None,
                 refuse_hard_links: bool = False) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename.

    Text is written as is (no newline translation), in ``encoding`` (the file's own: a fixed
    latin-1 file with its coding cookie stays latin-1; ``utf-8-sig`` keeps a BOM). An existing
    file keeps its permission bits and, where the process may set them, its owner and group; a
    new one gets the umask's bits. A file whose mode lets no one write is refused, even for root.
    ``expected``: the content ``path`` must still hold right before the rename
    (compare-and-swap); otherwise nothing is written. ``follow_links``: write through a link at
    ``path`` (``--fix``); an output comes resolved, with ``folder_fd``: its folder, opened when
    it was checked, so that a folder swapped for a link since then is not written through.
    ``shown``: how errors name the file. ``refuse_hard_links``: an existing file with more than
    one name is refused (``--fix``: the other names would keep the old text, the link split).
    """
    path = Path(path)
    if follow_links and path.is_symlink():
        path = Path(os.path.realpath(path))
    shown = shown or str(path)
    payload = data.encode(encoding, "surrogateescape") if isinstance(data, str) else data
    if folder_fd is not None:
        _replace_in(folder_fd, path.name, payload, expected, encoding, shown, refuse_hard_links)
        return
    folder_fd = open_folder(path.parent if str(path.parent) else Path("."), shown)
    try:
        _replace_in(folder_fd, path.name, payload, expected, encoding, shown, refuse_hard_links)
    finally:
        os.close(folder_fd)


def open_folder(folder: Path, shown: str) -> int:
    """A file descriptor of ``folder``, for writes relative to it."""
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"cannot write {shown}: {exc.strerror}") from None


def _replace_in(folder: int, name: str, payload: bytes, expected: str | None, encoding: str, shown: str,
                refuse_hard_links: bool = False) -> None:
    try:
        existing: os.stat_result | None = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        existing = None
    except OSError as exc:
        raise UsageError(f"cannot write {shown}: {exc.strerror}") from None
    if existing is not None:
        _check_writable(folder, name, existing, shown)
        if refuse_hard_links and existing.st_nlink > 1:
            others = existing.st_nlink - 1
            raise UsageError(f"{shown} has {existing.st_nlink} hard links: a new file renamed over this name would "
                             f"leave the other {others} name{'s' if others > 1 else ''} with the old text; not "
                             "rewritten (apply what --diff shows in an editor, or remove the other names)")
    tmp = f".{name[:200]}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
    except PermissionError:  # the file itself may be writable: the folder is what refuses
        raise UsageError(f"cannot write {shown}: its folder is not writable (the new text is written beside the "
                         "file, then renamed over it)") from None
    except OSError as exc:
        raise UsageError(f"cannot write {shown}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            os.fchmod(fh.fileno(), stat.S_IMODE(existing.st_mode) if existing is not None else 0o666 & ~umask())
            if existing is not None and (existing.st_uid, existing.st_gid) != (os.geteuid(), os.getegid()):
                with contextlib.suppress(OSError):  # only root (or the owner, for the group) may
                    os.fchown(fh.fileno(), existing.st_uid, existing.st_gid)
        if expected is not None and _read_in(folder, name, encoding) != expected:
            raise UsageError(f"{shown} changed since ampaudit read it: nothing written (run the command again)")
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise UsageError(f"cannot write {shown}: {exc.strerror or exc}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise


def _read_in(folder: int, name: str, encoding: str) -> str | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=folder)
    except FileNotFoundError:
        return None
    with open(fd, encoding=encoding, newline="") as fh:
        return fh.read()


def _check_writable(folder: int, name: str, existing: os.stat_result, shown: str) -> None:
    if stat.S_ISDIR(existing.st_mode):
        raise UsageError(f"cannot write {shown}: it is a folder")
    if stat.S_ISLNK(existing.st_mode):  # outputs are resolved first: a link now was planted since
        raise UsageError(f"{shown} became a symbolic link since it was checked: nothing written")
    if not existing.st_mode & 0o222:  # root may write anything: the mode still says no
        raise UsageError(f"{shown} is read-only: not rewritten (make it writable to allow it)")
    if os.access(name, os.W_OK, dir_fd=folder):
        return
    if existing.st_uid == os.geteuid() or os.geteuid() == 0:  # the mode allows it: an attribute or the mount not
        raise UsageError(f"{shown} cannot be written (immutable, or on a read-only file system): not rewritten")
    raise UsageError(f"{shown} cannot be written by this user: not rewritten")


def file_id(path: Path | str) -> tuple[int, int] | None:
    """What names one file however it is reached (links, relative parts, hard links): its
    device and inode; None when it cannot be read."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino
