"""The process boundary: ampaudit's work on a user's model runs in a child interpreter, so that
whatever the model's code does - ``os._exit``, a signal, a segfault, an allocation the machine
cannot hold, a hang, an ``os.chdir`` - happens to the child, and the parent turns it into one
line and an exit code. The parent has resolved every path before and owns every output after.

What crosses: the job (a function named by module and name, and its pickled arguments) goes in;
the clock of the user's code (``--import-timeout``: the parent kills the child when it runs out)
and one pickled result, ampaudit error or crash line come back (core/child_main.py). The child's
stdout goes to the parent's stderr: the user's prints never mix with a report on stdout.

Torch-free: for a job handed over, only the child imports torch.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from ampaudit.core.child_main import Job
from ampaudit.core.errors import AmpauditError, ModelNotBuilt

_BOOT = "import sys; sys.path[:] = {path!r}; from ampaudit.core.child_main import main; main({request}, {result})"
_DUMP_WAIT = 0.5  # seconds a timed-out child has to write where it was stopped, before SIGKILL
_TIMEOUT_HINT = 'move long-running code under `if __name__ == "__main__":`, or raise --import-timeout'


class ChildFailed(AmpauditError):
    """The child ended without a result (or with a crash line); ``remote_traceback``: the child's
    traceback, when there was one, for ``--debug``."""

    remote_traceback = ""


def run_in_child(module: str, function: str, *args: Any, import_timeout: float | None = None, **kwargs: Any) -> Any:
    """``module.function(*args, **kwargs)`` in a child interpreter; its return value, or the
    AmpauditError it raised, raised here. Failures while the user's code runs (core/child_main's
    ``user_code``) are :class:`ModelNotBuilt`, so that a model file that cannot be imported keeps
    its lint and gets AMP005; failures after it are :class:`ChildFailed`, exit 2."""
    request_r, request_w = os.pipe()
    result_r, result_w = os.pipe()
    dump_r, dump_w = os.pipe()
    job = Job(module, function, args, kwargs, list(sys.argv), list(sys.path), memory_limit(), dump_w)
    os.set_blocking(dump_r, False)
    stderr_fd = _stream_fd(sys.stderr)  # None: captured (pytest, a notebook), the child's output is copied
    output = subprocess.PIPE if stderr_fd is None else stderr_fd
    try:
        boot = _BOOT.format(path=list(sys.path), request=request_r, result=result_w)
        process = subprocess.Popen([sys.executable, "-u", "-c", boot], pass_fds=(request_r, result_w, dump_w),
                                   stdout=output, stderr=output)
    except BaseException:
        for fd in (request_r, request_w, result_r, result_w, dump_r, dump_w):
            os.close(fd)
        raise
    for fd in (request_r, result_w, dump_w):
        os.close(fd)
    results = Connection(result_r, writable=False)
    try:
        with Connection(request_w, readable=False) as requests, contextlib.suppress(BrokenPipeError):
            requests.send(job)  # a child that died first: its exit status says why
        return _wait(process, results, dump_r, import_timeout)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        results.close()
        os.close(dump_r)
        if process.stdout is not None:
            process.stdout.close()


def _wait(process: subprocess.Popen, results: Connection, dump_r: int, timeout: float | None) -> Any:
    running: str | None = None  # what of the user's code runs now, per the child's clock
    file: str | None = None
    deadline: float | None = None
    sources: list[Any] = [results] + ([process.stdout] if process.stdout is not None else [])
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise _timed_out(process, dump_r, running or "the model's code", file, timeout or 0)
        ready = wait(sources, left)
        if process.stdout is not None and process.stdout in ready:
            _relay(process, sources)
        if results not in ready:
            continue
        try:
            message = results.recv()
        except EOFError:
            break
        kind = message[0]
        if kind == "clock":
            running, file = message[1], message[2]
            deadline = time.monotonic() + timeout if running is not None and timeout else None
        elif kind == "result":
            return message[1]
        elif kind == "error":
            message[1].remote_traceback = message[2]
            raise message[1]
        elif kind == "crash":
            error = ChildFailed(message[1]) if running is None else ModelNotBuilt(
                f"{running}: {message[1]}", reason=f"{running}: {message[1]}", hint="fix the model's code")
            error.remote_traceback = message[2]
            raise error
    while process.stdout is not None and process.stdout in sources:
        _relay(process, sources)
    raise _died(process.wait(), running)


def _relay(process: subprocess.Popen, sources: list[Any]) -> None:
    chunk = os.read(process.stdout.fileno(), 65536)
    if not chunk:
        sources.remove(process.stdout)
        return
    sys.stderr.write(chunk.decode(errors="replace"))


def _died(status: int, running: str | None) -> AmpauditError:
    """The child ended without a word: by its own exit (``os._exit`` in the model) or a signal."""
    if status < 0:
        name = _signal_name(-status)
        cause = {signal.SIGKILL: f"was killed by {name} (out of memory? the system's out-of-memory killer sends it)",
                 signal.SIGSEGV: f"crashed ({name}, a segmentation fault in native code)"}.get(
            -status, f"was ended by {name}")
    else:
        cause = f"exited with status {status} (os._exit?)"
    if running is None:
        return ChildFailed(f"the child process running the model {cause}")
    return ModelNotBuilt(f"{running}: the model's code {cause}", reason=f"the model's code {cause} while {running}",
                         hint="fix the model's code, or audit a model that builds without it")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _timed_out(process: subprocess.Popen, dump_r: int, running: str, file: str | None, seconds: float) -> ModelNotBuilt:
    """Stop the child: first ask where it is (faulthandler dumps its stack on SIGUSR1, even in a
    loop that never returns to Python's eval loop), then kill it."""
    line = None
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGUSR1)
        line = _line_in_dump(dump_r, file)
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    at = f" at line {line}" if line is not None else ""
    return ModelNotBuilt(f"{running} was stopped after {seconds:g} s{at} (--import-timeout)",
                         reason=f"{running} was still running after {seconds:g} s, stopped{at}",
                         hint=_TIMEOUT_HINT, line=line)


def _line_in_dump(dump_r: int, file: str | None) -> int | None:
    """The innermost line of ``file`` in the stack the child dumped (most recent call first)."""
    text = b""
    end = time.monotonic() + _DUMP_WAIT
    while time.monotonic() < end:
        time.sleep(0.05)
        try:
            chunk = os.read(dump_r, 65536)
        except BlockingIOError:
            chunk = b""
        if text and not chunk:  # the whole dump is written at once: it has stopped growing
            break
        text += chunk
    if file is None:
        return None
    for match in re.finditer(rb'File "(.+?)", line (\d+)', text):
        with contextlib.suppress(OSError):
            if os.path.samefile(os.fsdecode(match[1]), file):
                return int(match[2])
    return None


def _stream_fd(stream: Any) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # captured (io.UnsupportedOperation is both)
        return None


def memory_limit() -> int | None:
    """The child's address-space limit: the machine's memory and swap, so that an allocation that
    could never fit fails in the child instead of waking the out-of-memory killer. None where
    a GPU driver is present: CUDA and ROCm reserve address space far beyond the memory."""
    if any(Path(device).exists() for device in ("/dev/nvidiactl", "/dev/kfd")):
        return None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return memory + _swap_bytes()


def _swap_bytes() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("SwapTotal:"):
                return int(line.split()[1]) * 1024
    return 0
