"""``ampaudit run script.py [args]``: the script runs as __main__, untouched, with watch
attached to every module that runs forward and every optimizer (or GradScaler) that steps."""

from __future__ import annotations

import runpy
import sys
import traceback
from pathlib import Path

from ampaudit.core.errors import UsageError
from ampaudit.watch.monitor import Monitor, NonFiniteError
from ampaudit.watch.options import WatchOptions


def run_script(script: Path, argv: list[str], options: WatchOptions) -> int:
    """Run ``script`` as __main__ with ``argv``, watched with ``options``; its exit code."""
    if not script.is_file():
        raise UsageError(f"no such script: {script}")
    monitor = Monitor(None, options=options)
    monitor.builder.source = {"file": str(script), "line": 0}  # the findings point at the script
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.resolve().parent))
    code = 0
    monitor.start()
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:  # the script's own exit code is ours, and its message, as python shows them
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            sys.stderr.write(f"{exc.code}\n")
    except KeyboardInterrupt:
        code = 130
        sys.stderr.write("ampaudit run: interrupted\n")
    except NonFiniteError as exc:  # --stop-on-nonfinite: the reason, not the script's stack
        code = exc.exit_code
        sys.stderr.write(f"ampaudit run: stopped: {exc}\n")
    except BaseException:
        traceback.print_exc()  # the script's error, shown as python would show it
        code = 1
    finally:
        monitor.stop()
        sys.argv, sys.path[:] = saved_argv, saved_path
    from ampaudit.core.console import make_console
    from ampaudit.watch.render import render_summary

    render_summary(monitor.summary(), make_console(sys.stderr))
    failure = monitor.sink.failure
    if options.log is not None and failure is not None:
        sys.stderr.write(f"ampaudit run: the log {options.log} stops early: {failure}\n")
    elif options.log is not None:
        sys.stderr.write(f"ampaudit run: log written to {options.log}\n")
    return code
