"""The watch log (JSON lines: a header, then one record per logged step, then the end: the
run's counts after its last logged step and the final loss scale): written by a running watch
(``LogSink``), read as a stream (``open_log``).

A log can be gigabytes: it is read one line at a time and never held whole. A run that died
mid-write leaves a partial last line, which is skipped; a bad line anywhere else is an error
naming the line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import sys
from collections.abc import Generator
from contextlib import closing
from pathlib import Path
from typing import Any, TextIO

from ampaudit.core.errors import UsageError
from ampaudit.core.outputs import resolve_output
from ampaudit.core.paths import display_path
from ampaudit.watch.line_shape import LineShapes, Matched
from ampaudit.watch.log_schema import end_problem, step_problem
from ampaudit.watch.stats_merge import LOG_ROW, stats_from_row

# the header's "ampaudit_watch" value: 2 writes Stats as rows (``stats_merge.LOG_ROW``), 3 ends
# with {"end": {...}} (what happened after the last logged step: eval forwards, steps, forks)
FORMAT_VERSION = 3
READS = (1, 2, 3)  # the versions read: 1 wrote each Stats as its dict
# A log grows by ~0.5 kB a module a step (15 kB a step for nanoGPT's 28 modules): days of
# training fill a disk. It stops before it takes the space the script needs for its own
# checkpoints: it takes at most this share of the space free on its disk when it opened.
LOG_SHARE = 0.5
# A line is read whole: a file that is no log (a checkpoint, a sparse file of zeros, a JSON dump
# given by mistake) could be one line of gigabytes, held three times over while it is parsed. A
# header is a few hundred bytes; a step line about half a kilobyte a module and parameter.
MAX_HEADER = 2**20
MAX_LINE = 2**28


def create_log(path: Path, header: dict[str, Any]) -> TextIO:
    """Open a new log for writing, its header written. It replaces an earlier watch log, never
    another file: a folder, a missing folder, a file that is not a watch log, a planted link
    (core/outputs.py) or a log another watch is still writing (it holds an exclusive lock while
    it writes) is a one-line UsageError before anything is written. A device or a FIFO is
    written in place."""
    shown = display_path(str(path))
    output = resolve_output(shown, "the log")
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:  # O_NOFOLLOW: a link planted since the check is refused; O_NONBLOCK: no wait for a FIFO's reader
        if output.kind == "fd":
            fd = os.dup(output.fd)
        elif output.folder_fd is not None:
            fd = os.open(output.target.name, flags, 0o666, dir_fd=output.folder_fd)
        else:
            fd = os.open(output.target, flags, 0o666)
    except OSError as exc:
        cause = "a FIFO that no process reads" if exc.errno == errno.ENXIO else exc.strerror
        raise UsageError(f"cannot write the log {shown}: {cause}") from None
    finally:
        output.close()
    try:
        os.set_blocking(fd, True)
        if output.kind in ("new", "file"):
            _claim(fd, output.target, shown)
        handle = os.fdopen(fd, "w", encoding="utf-8", closefd=True)
    except BaseException:
        os.close(fd)
        raise
    try:
        handle.write(json.dumps({"ampaudit_watch": FORMAT_VERSION, **header, "row": list(LOG_ROW)}) + "\n")
        handle.flush()
    except OSError as exc:
        if output.kind in ("new", "file"):  # emptied by ``_claim``: an empty log would be all it left
            _remove_own(handle.fileno(), output.target)
        with contextlib.suppress(OSError):
            handle.close()
        raise UsageError(f"cannot write the log {shown}: {exc.strerror or exc}") from None
    return handle


def _remove_own(fd: int, target: Path) -> None:
    """Remove the log this process created or emptied - still the file at ``target``, not one
    put there since - whose header could not be written (a full disk)."""
    with contextlib.suppress(OSError):
        mine, there = os.fstat(fd), os.lstat(target)
        if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
            os.unlink(target)


def _claim(fd: int, target: Path, shown: Path | str) -> None:
    """Lock a regular log file for this writer and empty it - unless another watch holds it or
    it is not a watch log."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UsageError(f"the log {shown} is being written by another watch: refusing a second writer "
                         "(name another log)") from None
    except OSError as exc:  # a file system without locks (NFS with no lock manager: ENOLCK): written unlocked
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
    info = os.fstat(fd)
    if not info.st_mode & 0o222:  # root may write anything: the mode still says no
        raise UsageError(f"the log {shown} is read-only: not rewritten (make it writable to allow it)")
    if info.st_size and not _is_log(target):
        raise UsageError(f"the log {shown} exists and is not an ampaudit watch log: refusing to overwrite it")
    os.ftruncate(fd, 0)


class LogSink:
    """Where a watch writes its records: a log at ``path``, or nowhere (``path`` None, or a
    rank other than 0). Each record is one line, flushed at once: a crash leaves every
    finished step readable."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._handle: TextIO | None = None
        self.failure: str | None = None  # why writing stopped early (a full disk), if it did
        self.last_step: int | None = None  # the last step written whole
        self._regular = False  # a regular file: no other writer may have touched it since (``_taken``)
        self._floor = 0  # the free bytes on its disk it never writes below (``_disk_nearly_full``)
        self._guarded = False  # its disk reports its size: ``_floor`` applies

    @property
    def is_open(self) -> bool:
        """Whether records are written (someone reads per-step numbers)."""
        return self._handle is not None

    def open(self, header: dict[str, Any]) -> None:
        """Create the log (``create_log``: refused over anything but an earlier log)."""
        if self.path is not None:
            self._handle = create_log(self.path, header)
            self._regular = stat.S_ISREG(os.fstat(self._handle.fileno()).st_mode)
            if self._regular:
                disk = os.fstatvfs(self._handle.fileno())
                # no blocks at all: a size=0 (unlimited) tmpfs, a FUSE file system without statfs -
                # a disk that reports no size, not a full one: nothing to guard by
                self._guarded = disk.f_blocks > 0
                self._floor = int(disk.f_bavail * disk.f_frsize * (1 - LOG_SHARE))

    def write(self, record: dict[str, Any]) -> None:
        if self._handle is not None:
            self.write_line(json.dumps(record), record.get("step"))

    def write_line(self, line: str, step: int | None = None) -> None:
        """One record, already JSON (``log_text.LogLines``); ``step``: the step it records, if any."""
        if self._handle is None:
            return
        try:
            if self._taken() or self._disk_nearly_full():
                return
            self._handle.write(line + "\n")
            self._handle.flush()
            if step is not None:
                self.last_step = step
        except OSError as exc:  # a full disk or `ulimit -f` must not stop the training: stop logging
            self._stop(str(exc.strerror or exc), f"could not be written ({exc.strerror or exc}): logging stopped")

    def _taken(self) -> bool:
        """Whether another writer emptied, wrote or replaced the log since this one last wrote
        it - the script writing its own file at that path (``--log metrics.jsonl``): the watch
        would write at its own offset into the script's data, NUL bytes between. Such a log is
        the other writer's from then on, left as it has it. (An fstat a step.)"""
        if not self._regular:  # a FIFO or a device: written in place, no size to compare
            return False
        fd = self._handle.fileno()
        info = os.fstat(fd)
        if info.st_nlink and info.st_size == os.lseek(fd, 0, os.SEEK_CUR):
            return False
        what = f"{'removed or replaced' if not info.st_nlink else 'written'} by another process (the script itself?)"
        self._stop(f"{what}, the file left as it is", f"was {what}: logging stopped, the file left as it is")
        return True

    def _disk_nearly_full(self) -> bool:
        """Whether the log's file system is down to the free space it leaves to the script
        (``LOG_SHARE``): logging stops there, the file kept as written. (An fstatvfs a step.)"""
        if not (self._regular and self._guarded):
            return False
        disk = os.fstatvfs(self._handle.fileno())
        free = disk.f_bavail * disk.f_frsize
        if free > self._floor:
            return False
        left = f"{free / 2**20:.0f} MB free"
        self._stop(f"the disk is nearly full ({left})", f"stopped: {left} on its disk, kept for the script")
        return True

    def _stop(self, failure: str, said: str) -> None:
        """Stop logging, say why once on stderr (the script may have closed it); training goes on."""
        with contextlib.suppress(OSError):
            self._handle.close()
        self._handle = None
        self.failure = failure
        with contextlib.suppress(OSError, ValueError, AttributeError):
            sys.stderr.write(f"ampaudit: the log {display_path(str(self.path))} {said}, training goes on\n")

    def abandon(self) -> None:
        """In a forked child: forget the log without writing or flushing it (it is the parent's;
        every record was flushed as written, so nothing of the parent's is pending)."""
        self._handle = None
        self.path = None

    def close(self, end: dict[str, Any] | None = None, final_scale: float | None = None) -> None:
        """The last line - ``end``, the run's counts as the live summary has them (steps, eval
        forwards, forks, unmeasured tensors: some come after the last logged step), and the loss
        scale after the last ``update()``, with a GradScaler - then close."""
        if end is not None or final_scale is not None:
            self.write({"end": end or {}, **({"final_scale": final_scale} if final_scale is not None else {})})
        if self._handle is not None:
            with contextlib.suppress(OSError):  # the last flush of a full disk: said by write() already
                self._handle.close()
            self._handle = None


def _is_log(path: Path) -> bool:
    try:
        _, records = open_log(path)
    except UsageError:
        return False
    records.close()  # only the header was read
    return True


def open_log(path: Path, *, steps_only: bool = False) -> tuple[dict[str, Any], Generator[dict[str, Any], None, None]]:
    """The log's header (``{"ampaudit_watch": 1, "dtype": ...}``) and an iterator over its
    records, in order: one per step, and the end last (``{"end": {...}, "final_scale": ...}``;
    format 2: ``{"final_scale": ...}``), not with ``steps_only``. A step line that matches its
    shape (``line_shape``) has its rows checked by that one match."""
    header, rows = open_rows(path)
    lines = (record for record, _ in rows)
    if header["ampaudit_watch"] >= 2:
        lines = _as_stats(lines, header["row"], path)
    return header, (r for r in lines if "step" in r) if steps_only else lines


def open_rows(path: Path) -> tuple[dict[str, Any], Generator[tuple[dict[str, Any], Matched | None], None, None]]:
    """``open_log``'s header and records, each with what ``line_shape`` proved of its rows:
    ``(shape, rows)`` where its line matched its shape - its rows, lists of numbers, as the
    fast readers take them - else None (the header, the end, a format-1 log, a line that
    takes the slow path: ``as_stats`` gives its Stats dicts). A format-2 record's rows stay
    lists either way."""
    lines = _lines(path)
    first = next(lines, None)
    if first is None:
        raise UsageError(f"{path} is empty")
    header = first[0]
    if header["ampaudit_watch"] >= 2:
        _row_names(header.get("row"), path)
    return header, lines


def _row_names(names: Any, path: Path) -> list[str]:
    if not (isinstance(names, list) and "hist_from" in names and all(isinstance(n, str) for n in names)):
        raise UsageError(f"{path}: its header does not name the fields of a row")
    return names


def _as_stats(records: Generator[dict[str, Any], None, None], names: list[str],
              path: Path) -> Generator[dict[str, Any], None, None]:
    """Format 2 records with each Stats row as its dict, as format 1 wrote them: what every
    reader of a log works with (``names``: the header's, checked by ``open_rows``)."""
    with closing(records):
        for record in records:
            if "step" in record:
                as_stats(record, names, path)
            yield record


def as_stats(record: dict[str, Any], names: list[str], path: Path) -> None:
    """A format-2 step record's rows as Stats dicts, in place (``stats_merge.stats_from_row``;
    the gradient norm and the count overflowing at the loss scale joined to each parameter's)."""
    try:
        record["layers"] = {module: {phase: stats_from_row(row, names) for phase, row in phases.items()}
                            for module, phases in record["layers"].items()}
        norms, scaled = record.pop("norms", {}), record.pop("overflow_at_scale", None)
        params = {}
        for name, row in record["params"].items():
            params[name] = stats = stats_from_row(row, names)
            stats["norm"] = norms.get(name)
            if scaled is not None:
                stats["overflow_at_scale"] = scaled.get(name, 0)
        record["params"] = params
    except (TypeError, ValueError, AttributeError):
        raise UsageError(f"{path}: step {record['step']}: a malformed row") from None


def _lines(path: Path) -> Generator[tuple[dict[str, Any], Matched | None], None, None]:
    """The log's records, checked, each as ``(record, matched)``: what ``LineShapes.match``
    proved of a step line's rows, or None."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 (closed below; a generator keeps it open while read)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    with handle:
        pending: str | None = None  # a bad line: an error unless it is the last one
        header = False
        line_shapes: LineShapes | None = None
        ended: int | None = None  # the end record's line: the last
        number = 0
        while raw := handle.readline((MAX_LINE if header else MAX_HEADER) + 1):
            number += 1
            if len(raw) > (MAX_LINE if header else MAX_HEADER):
                if not header:
                    raise UsageError(f"{path} is not an ampaudit watch log (its first line runs past "
                                     f"{MAX_HEADER // 2**20} MB; a log's header is a few hundred bytes)")
                raise UsageError(f"{path}:{number}: a line longer than {MAX_LINE // 2**20} MB: no log writes one")
            if not raw.strip():
                continue
            if pending is not None:
                raise UsageError(pending)
            try:
                text = raw.decode("utf-8")
                record = json.loads(text)
            except UnicodeDecodeError:
                pending = f"{path}:{number}: not UTF-8 text"
                continue
            except json.JSONDecodeError:
                pending = f"{path}:{number}: not a JSON line"
                continue
            except RecursionError:  # a line nested deeper than the parser goes: no log writes that
                raise UsageError(f"{path}:{number}: nested too deeply to be a log record") from None
            except ValueError:  # an integer of more digits than int() converts (4300)
                raise UsageError(f"{path}:{number}: a number too long to be a log's") from None
            if ended is not None:  # two logs joined, or a line written after the run's end
                raise UsageError(f"{path}:{number}: a record after the log's end (line {ended})")
            if not isinstance(record, dict):
                raise UsageError(f"{path}:{number}: a {type(record).__name__}, not a JSON object")
            if not header:
                version = record.get("ampaudit_watch")
                if type(version) is not int:  # true == 1 to Python: not to a log
                    version = None
                if isinstance(version, int) and version > max(READS) and isinstance(record.get("dtype"), str):
                    raise UsageError(f"{path} is a watch log of format {version}, from a newer ampaudit: this "
                                     f"one reads formats {READS[0]}-{READS[-1]}")
                if version not in READS or not isinstance(record.get("dtype"), str):
                    raise UsageError(f"{path} is not an ampaudit watch log (its first line is no ampaudit_watch "
                                     "header)")
                header = True
                names = record.get("row") if isinstance(record.get("row"), list) else None
                if version >= 2:
                    line_shapes = LineShapes(names)
                yield record, None
                continue
            if "ampaudit_watch" in record and "step" not in record:  # two runs wrote it (no lock), or logs joined
                raise UsageError(f"{path}:{number}: a second header: two runs wrote this log, or two logs were joined")
            if "step" not in record and ("end" in record or "final_scale" in record):
                problem = end_problem(record)  # written at stop(): the run's end, the final loss scale
                if problem:
                    raise UsageError(f"{path}:{number}: {problem}")
                ended = number
                yield record, None
                continue
            if "step" not in record or "layers" not in record or "params" not in record:
                raise UsageError(f"{path}:{number}: not a step record (needs step, layers and params)")
            matched = line_shapes.match(text, record) if line_shapes is not None else None
            problem = step_problem(record, version, names, rows_checked=matched is not None)
            if problem:
                raise UsageError(f"{path}:{number}: {problem}")
            yield record, matched
        if not header and pending is not None:
            raise UsageError(pending)  # nothing but a bad line: not a log, not a crash
