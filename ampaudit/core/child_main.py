"""The child side of the process boundary (core/child.py is the parent's): a fresh interpreter
that runs one of ampaudit's jobs on a user's model and sends back what came of it.

The job arrives pickled on an inherited pipe; what goes back, on another, is a sequence of
messages: ``("clock", WHAT)`` when the user's code starts running (import, model build,
``example_inputs()``: the part ``--import-timeout`` limits, which the parent enforces by killing
this process) and ``("clock", None)`` when it ends, then exactly one ``("result", VALUE)``,
``("error", AMPAUDIT_ERROR, TRACEBACK)`` or ``("crash", ONE_LINE, TRACEBACK)``. Anything else -
``os._exit``, a signal, a segfault - the parent reads from the exit status.

Torch-free until the job imports it: the parent never needs torch for a job it hands over.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import os
import resource
import signal
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ampaudit.core.errors import AmpauditError

_channel: Connection | None = None  # set in a child: where messages to the parent go


@dataclass
class Job:
    """What the parent asks: ``module.function(*args, **kwargs)``, run as ``argv`` with ``path``."""

    module: str
    function: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    argv: list[str]
    path: list[str]
    memory_limit: int | None  # bytes of address space; None: unlimited
    dump_fd: int  # where the stack goes on SIGUSR1: the parent asks where a timed-out child was


def in_child() -> bool:
    return _channel is not None


@contextlib.contextmanager
def user_code(what: str, file: Path | None = None) -> Iterator[None]:
    """Mark the user's code that ``--import-timeout`` limits (``what``: "importing model.py";
    ``file``: the model file, whose line a stop names). In a child the parent keeps the clock;
    the working folder the user's code may change (``os.chdir`` in ``get_model()``) is restored
    afterwards, so that paths in the report stay relative to where ampaudit was started.
    In-process it does nothing."""
    if _channel is None:
        yield
        return
    cwd = os.getcwd()
    _channel.send(("clock", what, str(file) if file is not None else None))
    try:
        yield
    finally:
        _channel.send(("clock", None, None))
        with contextlib.suppress(OSError):
            os.chdir(cwd)


def main(request_fd: int, result_fd: int) -> None:
    """Run the job read from ``request_fd``; never returns (the process ends with ``os._exit``
    so that threads and atexit handlers the user's code left behind cannot keep it alive)."""
    global _channel
    with Connection(request_fd, writable=False) as requests:
        job: Job = requests.recv()
    _channel = Connection(result_fd, readable=False)
    sys.argv[:] = job.argv  # the user's code sees what it saw in-process: ampaudit's command line
    sys.path[:] = job.path
    if hasattr(signal, "SIGXFSZ"):  # over `ulimit -f` a write fails with EFBIG, said in one line
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _limit_memory(job.memory_limit)
    faulthandler.register(signal.SIGUSR1, file=job.dump_fd, all_threads=True)
    code = 0
    try:
        function = getattr(importlib.import_module(job.module), job.function)
        message: tuple[Any, ...] = ("result", function(*job.args, **job.kwargs))
    except AmpauditError as exc:
        message = ("error", exc, _traceback(exc.__cause__ or exc))
    except KeyboardInterrupt:
        code, message = 130, ()
    except MemoryError as exc:
        message = ("crash", "ran out of memory (the address-space limit is the machine's memory)", _traceback(exc))
    except BaseException as exc:
        message = ("crash", _one_line(exc), _traceback(exc))
    try:
        if message:
            _channel.send(message)
    except Exception as exc:
        _channel.send(("crash", f"cannot send the result back: {_one_line(exc)}", _traceback(exc)))
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"the model's code called exit({exc.code!r})"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"unexpected {type(exc).__name__}: {text}" if text else f"unexpected {type(exc).__name__}"


def _traceback(exc: BaseException) -> str:
    try:
        return "".join(traceback.format_exception(exc))
    except Exception:
        return ""


def _limit_memory(limit: int | None) -> None:
    """Cap the address space, so that an allocation that cannot fit fails with MemoryError here
    instead of waking the system's out-of-memory killer (which may pick another process)."""
    if not limit:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft > limit:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
