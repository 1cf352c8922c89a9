"""Where an output goes, decided once, before any user code runs.

A command's output path (``-o``, ``--plot``, ``--log``, ``--tensorboard``, convert's ``-o``)
is resolved when the command starts: made absolute (a model that calls ``os.chdir`` cannot
move it), its symbolic links checked, and its kind fixed:

- a missing path or a regular file is written atomically (a temporary file renamed over it);
- ``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N`` are the process's own descriptors, written to;
- a character device or a FIFO (``/dev/null``, a named pipe) is written in place, never
  replaced; a FIFO with no reader is refused rather than waited on;
- a block device, a socket, or a folder where a file is wanted is refused.

A symbolic link is followed only when the running user or root owns it and the folder that
holds it is not writable by others: a link planted in a shared folder (``/tmp``) by another
user is refused, whoever runs ampaudit (the kernel's ``fs.protected_symlinks`` applies the
same idea to sticky folders; a rename into the link's target would bypass it). The target's
folder is opened when checked, and the write happens in that open folder: a later swap of a
folder for a link is not followed. docs/files.md states every rule.

An output never names a file the command reads: ``inputs`` are compared by device and inode.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ampaudit.core.errors import UsageError
from ampaudit.core.files import file_id, open_folder, write_atomic
from ampaudit.core.paths import display_path

_MAX_LINKS = 40  # as the kernel's ELOOP limit


_FD_PATH = re.compile(r"/dev/(?:fd/(?P<n>\d+)|(?P<std>stdout|stderr))|/proc/self/fd/(?P<p>\d+)")


@dataclass
class Output:
    """A resolved output. ``target``: where the bytes land (a followed link's target);
    ``kind``: "new", "file", "stream" (a device or FIFO, written in place), "fd" (``/dev/stdout``:
    written to the process's own descriptor ``fd``) or "folder". ``folder_fd``: the target's
    folder, opened when it was checked (the write goes there, whatever its path names later)."""

    flag: str
    path: Path
    target: Path
    kind: str
    shown: str = ""  # the path as the user wrote it, for messages
    fd: int | None = None
    folder_fd: int | None = None

    def __str__(self) -> str:
        return self.shown or str(self.path)

    def close(self) -> None:
        if self.folder_fd is not None:
            os.close(self.folder_fd)
            self.folder_fd = None

    def __del__(self) -> None:
        try:  # noqa: SIM105 - not contextlib.suppress: at interpreter exit the module's globals may be None already
            self.close()
        except Exception:
            pass


def _check_link(link: Path, flag: str, shown: str, absolute: Path) -> None:
    """Refuse to follow ``link`` unless the running user or root owns it and no one else can
    swap it: in a folder others may write, only the user's own link in a sticky folder."""
    owner = os.lstat(link).st_uid
    which = f"{flag} {shown} is" if link == absolute else f"{flag} {shown}: {link} is"
    if owner not in (os.geteuid(), 0):
        raise UsageError(f"{which} a symbolic link owned by another user (uid {owner}): not followed "
                         "(remove it, or write elsewhere)")
    folder = os.stat(link.parent).st_mode
    if folder & stat.S_IWOTH and not (folder & stat.S_ISVTX and owner == os.geteuid()):
        raise UsageError(f"{which} a symbolic link in a folder others can write: not followed")


def _resolve(path: Path, flag: str, shown: str) -> Path:
    """``path`` with every symbolic link (in any component) checked and followed, /proc's too
    (``/proc/self/cwd`` leads to a real folder, checked like any other)."""
    parts = list(path.parts[1:])
    current = Path(path.anchor)
    hops = 0
    while parts:
        current = current / parts.pop(0)
        try:
            is_link = stat.S_ISLNK(os.lstat(current).st_mode)
        except FileNotFoundError:
            return Path(current, *parts)
        except NotADirectoryError:
            raise UsageError(f"{flag} {shown}: {display_path(str(current.parent))} is a file, not a folder") from None
        except OSError as exc:
            raise UsageError(f"{flag} {shown}: {exc.strerror}") from None
        if not is_link:
            continue
        hops += 1
        if hops > _MAX_LINKS:
            raise UsageError(f"{flag} {shown}: too many levels of symbolic links")
        _check_link(current, flag, shown, path)
        pointed = Path(os.readlink(current))
        if not pointed.is_absolute() and ":" in pointed.parts[0] and str(current).startswith("/proc/"):
            return Path(current, *parts)  # a pipe or socket behind /proc/PID/fd/N: no path to follow
        base = current.parent if not pointed.is_absolute() else Path(pointed.anchor)
        parts = list(pointed.parts[1:] if pointed.is_absolute() else pointed.parts) + parts
        current = base
    return Path(os.path.normpath(current))


def _same_as_input(target: Path, inputs: Iterable[Path | str | None]) -> Path | None:
    mine = file_id(target)
    if mine is None:
        return None
    return next((Path(item) for item in inputs if item is not None and file_id(item) == mine), None)


def resolve_output(path: Path | str, flag: str, *, inputs: Iterable[Path | str | None] = (),
                   folder: bool = False) -> Output:
    """Decide where ``path`` is written (module docstring); a one-line UsageError otherwise.
    ``folder``: the output is a folder (created when missing) rather than a file."""
    text = str(path)
    if not text.strip():
        raise UsageError(f"{flag}: an empty path")
    try:
        absolute = Path(os.path.abspath(text))
    except OSError as exc:  # the working folder was deleted
        raise UsageError(f"{flag} {text}: the working folder is gone ({exc.strerror})") from None
    own = _FD_PATH.fullmatch(str(absolute))
    if own and not folder:  # the process's own stdout/stderr/fd N: written to, never replaced or reopened
        number = int(own["n"] or own["p"] or (1 if own["std"] == "stdout" else 2))
        try:
            os.fstat(number)
        except OSError:
            raise UsageError(f"{flag} {text}: descriptor {number} is not open") from None
        return Output(flag, absolute, absolute, "fd", text, fd=number)
    target = _resolve(absolute, flag, text)
    kind = _kind(target, flag, text, folder)
    clash = _same_as_input(target, inputs)
    if clash is not None:
        raise UsageError(f"{flag} {text} is an input of this command ({clash}): refusing to overwrite it")
    output = Output(flag, absolute, target, kind, text)
    if not folder:  # a file, device or FIFO: written inside the folder opened now
        output.folder_fd = _open_checked_folder(absolute, target, flag, text)
    return output


def _open_checked_folder(absolute: Path, target: Path, flag: str, shown: str) -> int:
    """The target's folder, opened, and checked again after opening: a folder swapped for a
    link between the check and the open is refused, and later swaps no longer matter."""
    folder_fd = open_folder(target.parent, f"{flag} {shown}")
    try:
        again = _resolve(absolute, flag, shown).parent
        held, named = os.fstat(folder_fd), os.stat(again)
    except BaseException:
        os.close(folder_fd)
        raise
    if (held.st_dev, held.st_ino) != (named.st_dev, named.st_ino):
        os.close(folder_fd)
        raise UsageError(f"{flag} {shown}: its folder changed while it was checked: nothing written")
    return folder_fd


def _kind(target: Path, flag: str, shown: str, folder: bool) -> str:
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        if folder:  # created with its missing parents: the nearest existing one must be writable
            existing = next(p for p in target.parents if p.exists())
            if not os.access(existing, os.W_OK | os.X_OK):
                raise UsageError(f"{flag} {shown}: the folder {display_path(str(existing))} is not writable") from None
            return "new"
        parent = target.parent
        named = Path(shown).parent if Path(os.path.abspath(shown)) == target else parent  # as the user wrote it
        if not parent.is_dir():
            raise UsageError(f"{flag} {shown}: no folder {named}") from None
        if not os.access(parent, os.W_OK):
            raise UsageError(f"{flag} {shown}: the folder {named} is not writable") from None
        return "new"
    except OSError as exc:
        raise UsageError(f"{flag} {shown}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        if folder and not os.access(target, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {shown}: the folder is not writable")
        if folder:
            return "folder"
        raise UsageError(f"{flag} {shown} is a folder: name a file")
    if folder:
        raise UsageError(f"{flag} {shown} is a file: name a folder")
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        return "stream"
    what = "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
    raise UsageError(f"{flag} {shown} is {what}: name a regular file")


def write_output(output: Output, data: str | bytes) -> None:
    """Write ``data`` to a resolved output: atomically, or in place for a stream. An Output is
    written once: its folder descriptor is closed after the write."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    if output.kind == "fd":
        _write_fd(output, payload)
    elif output.kind == "stream":
        _write_stream(output, payload)
    else:
        try:
            write_atomic(output.target, payload, follow_links=False, shown=f"{output.flag} {output}",
                         folder_fd=output.folder_fd)
        finally:
            output.close()


def _write_fd(output: Output, payload: bytes) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()  # what Python buffered goes first
    try:
        _write_all(output.fd, payload)
    except OSError as exc:
        raise UsageError(f"cannot write {output.flag} {output}: {exc.strerror}") from None


def _write_all(fd: int, payload: bytes) -> None:
    view = memoryview(payload)
    while view:
        view = view[os.write(fd, view):]


def _write_stream(output: Output, payload: bytes) -> None:
    shown = f"{output.flag} {output}"
    try:  # in the folder checked, never through a link put in the device's or FIFO's place since
        fd = os.open(output.target.name, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW,
                     dir_fd=output.folder_fd)
    except OSError as exc:
        output.close()
        if exc.errno == errno.ENXIO:
            raise UsageError(f"{shown} is a FIFO that no process reads: nothing written") from None
        raise UsageError(f"cannot write {shown}: {exc.strerror}") from None
    output.close()
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):  # swapped for a file since the check: not ours to write in place
            raise UsageError(f"{shown} became a regular file since it was checked: nothing written")
        os.set_blocking(fd, True)  # non-blocking only to not wait for a FIFO's reader
        _write_all(fd, payload)
    except OSError as exc:
        raise UsageError(f"cannot write {shown}: {exc.strerror}") from None
    finally:
        os.close(fd)


def refuse_special_file(path: Path | str, what: str) -> None:
    """An input the command reads whole must be a regular file: a FIFO would block and a device
    (``/dev/zero``) never end. A missing path is left to the reader's own message."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise UsageError(f"{what} {path} is not a regular file (a FIFO or a device): not read")
