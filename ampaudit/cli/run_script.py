"""``ampaudit run script.py [args]``: the script runs as __main__, untouched, with watch
attached to every module that runs forward and every optimizer (or GradScaler) that steps."""

from __future__ import annotations

import contextlib
import io
import os
import pkgutil
import runpy
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from ampaudit.cli import script_stack
from ampaudit.core.errors import UsageError
from ampaudit.core.paths import display_path, missing
from ampaudit.watch.monitor import Monitor, NonFiniteError
from ampaudit.watch.options import WatchOptions
from ampaudit.watch.own_frames import without_own_frames


def run_script(script: Path, argv: list[str], options: WatchOptions, *, optional_log: bool = False) -> int:
    """Run ``script`` as __main__ with ``argv`` its ``sys.argv`` (the first word the script as
    typed), watched with ``options``; its exit code.
    ``optional_log``: the log is run's default, not asked for - one that cannot be opened (an
    earlier run still writing it, another file of that name) leaves the script to train without."""
    if script.is_dir() and not (script / "__main__.py").is_file():  # python runs a folder's __main__.py
        raise UsageError(f"{script} is a folder without a __main__.py: name the script to run")
    if str(script) == "-" and not script.exists():  # python - reads the script from stdin
        raise UsageError("ampaudit run takes no script on stdin ('-'): save it to a file and name that")
    if not (script.is_file() or script.is_dir()):
        raise UsageError(missing(script, "script"))
    monitor = _monitor(script, options)
    if optional_log and options.log is not None:
        try:
            monitor.start()  # opens the log first: a refused one leaves no hook behind
        except UsageError as exc:
            say_without_log(exc)
            options = replace(options, log=None)
            monitor = _monitor(script, options)
    try:
        code, interrupted = _summarized(script, argv, monitor, options)
    except KeyboardInterrupt as exc:  # a second Ctrl-C in run's own end (the watch stopping, the summary):
        if getattr(exc, "from_script", False):  # it ends the process as the script's first would
            raise
        raise _uncaught_interrupt() from None
    if interrupted:  # as python ends then: killed by SIGINT after the atexit handlers (a shell loop stops)
        raise _uncaught_interrupt()
    return code


def _summarized(script: Path, argv: list[str], monitor: Monitor, options: WatchOptions) -> tuple[int, bool]:
    """``_run_watched``, then the summary on the kept stderr."""
    with _kept_stderr() as stderr:
        code, interrupted = _run_watched(script, argv, monitor, stderr)
        if monitor.forked_child:  # a fork that ran to the script's end: the parent reports
            return code, interrupted
        from ampaudit.core.console import make_console
        from ampaudit.watch.render import render_summary

        err = stderr()
        sink = monitor.sink
        with contextlib.suppress(OSError):  # a full disk under stderr: the script's exit code still stands
            render_summary(monitor.summary(), make_console(err))
            if options.log is not None and sink.failure is not None:
                last = "before its first step" if sink.last_step is None else f"after step {sink.last_step}"
                err.write(f"ampaudit run: the log {display_path(str(options.log))} stops {last}: {sink.failure}\n")
            elif options.log is not None:
                err.write(f"ampaudit run: log written to {display_path(str(options.log))}\n")
            err.flush()
    return code, interrupted


def _monitor(script: Path, options: WatchOptions) -> Monitor:
    monitor = Monitor(None, options=options)
    monitor.builder.source = {"file": str(script), "line": 0}  # the findings point at the script
    return monitor


def say_without_log(exc: Exception) -> None:
    """Why run's default log (not asked for) is left out: the script trains without it."""
    sys.stderr.write(f"ampaudit run: {exc}: watching without a log (--log FILE names one)\n")


def _uncaught_interrupt() -> KeyboardInterrupt:
    """A KeyboardInterrupt for python's top level to end the process with (``cli.main`` lets it
    through), printed by no one: the script's interruption was said already."""
    exc = KeyboardInterrupt()
    exc.from_script = True
    hook = sys.excepthook

    def quiet(kind, value, tb) -> None:
        if value is not exc:
            hook(kind, value, tb)

    sys.excepthook = quiet
    return exc


def _run_watched(script: Path, argv: list[str], monitor: Monitor, kept: Callable[[], TextIO]) -> tuple[int, bool]:
    """The script's exit code, and whether an uncaught KeyboardInterrupt ended it."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = list(argv)
    if not script.is_dir():  # a folder: run_path puts the folder itself first, as python does
        folder = str(script.resolve().parent)
        if sys.path and not _imports_ampaudit(sys.path[0]):
            sys.path[0] = folder  # python's first entry is the script's folder, not what started run
        else:  # ampaudit itself comes from there (a checkout, run with -m): kept, after the script's
            sys.path.insert(0, folder)
    code, interrupted = 0, False
    monitor.start()
    try:
        _run_main(script)
    except SystemExit as exc:  # the script's own exit code is ours, and its message, as python shows them
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            _stderr(kept).write(f"{exc.code}\n")
    except KeyboardInterrupt as exc:
        code, interrupted = 130, True
        _script_traceback(exc, _stderr(kept))
    except NonFiniteError as exc:  # --stop-on-nonfinite: the reason, not the script's stack
        code = exc.exit_code
        _stderr(kept).write(f"ampaudit run: stopped: {exc}\n")
    except BaseException as exc:
        _script_traceback(exc, _stderr(kept))
        code = 1
    finally:
        monitor.stop()
        sys.argv, sys.path[:] = saved_argv, saved_path
    return code, interrupted


def _imports_ampaudit(entry: str) -> bool:
    """Whether ampaudit was imported from sys.path entry ``entry`` ('' is the working folder):
    run's own later imports need it."""
    package = Path(__file__).resolve().parents[1]
    try:
        return package.parent == Path(entry or os.getcwd()).resolve()
    except OSError:
        return True


def _run_main(script: Path) -> None:
    """``script`` run as ``python script`` runs it: as ``__main__``, its ``__file__`` and its
    tracebacks' file names absolute, ``sys.argv[0]`` as typed. ``runpy.run_path`` sets
    ``sys.argv[0]`` to the path it is given, so a file runs here (compiled without this
    module's ``from __future__`` flags); a folder's ``__main__.py`` through run_path, given the
    folder as typed (its importer makes ``__file__`` absolute)."""
    if script.is_dir():  # runpy's frames under python too; their depth here varies by one: the room errs high
        with script_stack.as_python(script_stack.frames_below()):
            runpy.run_path(sys.argv[0], run_name="__main__")
        return
    path = os.path.join(os.getcwd(), sys.argv[0])  # python's own absolute path: ./s.py gives /cwd/./s.py
    with io.open_code(path) as f:
        code = pkgutil.read_code(f)  # python runs a compiled .pyc too
    if code is None:
        with io.open_code(path) as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __loader__=None, __package__=None, __spec__=None)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main  # pickle and multiprocessing's spawn look the script up there
    try:
        with script_stack.as_python(script_stack.frames_below()):
            exec(code, main.__dict__)
    finally:
        sys.modules["__main__"] = saved


def _script_traceback(exc: BaseException, out: TextIO) -> None:
    """The script's uncaught exception as python prints it: its traceback from the script's own
    module frame on, without runpy's frames and ours before it; none where the script never ran
    (a SyntaxError: its file, line and caret only, as python prints it)."""
    without_own_frames(exc)  # watch's wrappers and the loss probe's frames: python has none
    tb = exc.__traceback__
    while tb is not None and not (tb.tb_frame.f_code.co_name == "<module>"
                                  and tb.tb_frame.f_globals.get("__name__") == "__main__"):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=out)


def _stderr(kept: Callable[[], TextIO]) -> TextIO:
    """Where python would print the script's last words: its ``sys.stderr``, unless it closed it."""
    return kept() if getattr(sys.stderr, "closed", True) else sys.stderr


def _file_of(stream: TextIO) -> tuple[int, int] | None:
    """The (device, inode) behind ``stream``'s descriptor; None where it has none (closed)."""
    try:
        info = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None
    return info.st_dev, info.st_ino


@contextlib.contextmanager
def _kept_stderr() -> Iterator[Callable[[], TextIO]]:
    """The stream ampaudit's summary goes to, whatever the script did to ``sys.stderr`` (closed
    it, or replaced it with its own logger): the one there at the start, or - when the script
    closed that one - a copy of its file descriptor taken at the start. Afterwards
    ``sys.stderr`` is that stream again, so that ampaudit's own last words reach the user too."""
    original = sys.stderr
    copy: TextIO | None = None
    with contextlib.suppress(AttributeError, OSError, ValueError, io.UnsupportedOperation):
        copy = open(os.dup(original.fileno()), "w", encoding=getattr(original, "encoding", None) or "utf-8",  # noqa: SIM115
                    errors="replace", buffering=1)
    start = _file_of(copy) if copy is not None else None

    def stream() -> TextIO:
        # its descriptor closed by the script and taken by a file it opened: not written into that
        if not getattr(original, "closed", True) and (start is None or _file_of(original) == start):
            return original
        return copy if copy is not None else io.StringIO()  # nowhere left to write: say nothing

    try:
        yield stream
    finally:
        sys.stderr = stream()
        if copy is not None and sys.stderr is not copy:
            copy.close()
