"""Publishing a folder whole: it is written into a staging folder beside its final place
(``.NAME.ampaudit-PID-XXXXXXXX``), then renamed, or exchanged with the folder it replaces in one
atomic step (Linux ``renameat2(RENAME_EXCHANGE)``). A staging folder of a killed process is
removed by the next run (never one of a live process); SIGTERM during the work raises, so the
process's own is removed on the way out."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import signal
import tempfile
import threading
import types
from collections.abc import Iterator
from pathlib import Path

from ampaudit.core.errors import UsageError

STAGING = ".{name}.ampaudit-{pid}-"  # + mkdtemp's random characters
RANDOM = 8
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def os_cause(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc)
    # safetensors: "Error while serializing: I/O error: File too large (os error 27)"
    rust = re.search(r"I/O error: (.+?) \(os error \d+\)", text)
    return rust[1] if rust else (text.strip().splitlines() or [type(exc).__name__])[0]


def staging_home(target: Path) -> Path:
    """Beside OUT_DIR, so that the whole folder can be swapped; inside it where it cannot be
    anyway (its parent is not writable, or it is a mount point: a rename across file systems
    fails), and then the files move one by one."""
    try:
        if target.is_dir() and (not os.access(target.parent, os.W_OK | os.X_OK)
                                or os.stat(target).st_dev != os.stat(target.parent).st_dev):
            return target
    except OSError:
        pass
    return target.parent


def new_staging(target: Path, home: Path) -> Path:
    prefix = STAGING.format(name=target.name, pid=os.getpid())
    try:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=home))
    except OSError as exc:
        raise UsageError(f"cannot write in {home}: {os_cause(exc)}") from exc


def remove_stale_staging(target: Path) -> None:
    """Remove the staging folders that killed exports left beside (or in) ``target`` - never one of a
    live process (pid reuse only keeps a stale one longer)."""
    prefix, _, suffix = STAGING.format(name=target.name, pid="\0").rpartition("\0")
    pattern = re.compile(re.escape(prefix) + r"(\d+)" + re.escape(suffix) + rf"[a-z0-9_]{{{RANDOM}}}")
    entries = []
    for home in (target.parent, target):  # staged beside OUT_DIR, or inside it (_staging_home)
        with contextlib.suppress(OSError):
            entries += list(os.scandir(home))
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and not _alive(int(match[1])):
            shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # never a staging folder's: leave it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: another user's live process
        return True
    return True


class _Terminated(SystemExit):
    """SIGTERM arrived during an export."""


@contextlib.contextmanager
def cleanup_on_sigterm() -> Iterator[None]:
    """SIGTERM's default action ends the process at once, leaving the staging folder: during the
    export it raises instead, so that the finally-blocks remove it; then the process ends by
    SIGTERM, as it would have. A handler of the user's own is left alone, and only the main
    thread may set one."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # cleaned up: end as SIGTERM ends a process
        raise  # SIGTERM blocked: exit 143 instead
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _raise_terminated(signum: int, frame: types.FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
    raise _Terminated(128 + signum)


def exchange(a: Path, b: Path) -> bool:
    """Exchange two paths atomically (Linux renameat2 RENAME_EXCHANGE): one moment the earlier
    export is there, the next the new one. False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # no such symbol (not glibc >= 2.28, not Linux)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL):  # the kernel or the file system has no exchange
        return False
    raise OSError(code, os.strerror(code), str(b))


def swap_by_renames(staging: Path, target: Path) -> bool:
    """Without an exchange: the earlier export aside (named like a staging folder, so that a crash
    leaves it for the next export to remove), the new one in, the earlier one removed."""
    aside = new_staging(target, target.parent)
    try:
        os.rename(target, aside)  # onto the empty folder mkdtemp made
    except OSError:
        os.rmdir(aside)
        return False
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(aside, target)  # the earlier export back
        raise
    shutil.rmtree(aside, ignore_errors=True)
    return True
