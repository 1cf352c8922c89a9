"""``ampaudit run script.py [args]``: the script runs as __main__, untouched, with watch
attached to every module that runs forward and every optimizer (or GradScaler) that steps."""

from __future__ import annotations

import runpy
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from ampaudit.core.dtypes import LowDtype
from ampaudit.core.errors import UsageError
from ampaudit.watch.monitor import Monitor


def run_script(script: Path, argv: list[str], *, log: Path, every: int = 1, dtype: LowDtype | str | None = None,
               ignore: Sequence[str] = (), provenance: bool = True, inside_compile: bool = False) -> int:
    if not script.is_file():
        raise UsageError(f"no such script: {script}")
    monitor = Monitor(None, log=log, every=every, dtype=LowDtype.parse(dtype) if dtype is not None else None,
                      ignore=ignore, provenance=provenance, inside_compile=inside_compile)
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
    except BaseException:
        traceback.print_exc()  # the script's error, shown as python would show it
        code = 1
    finally:
        monitor.stop()
        sys.argv, sys.path[:] = saved_argv, saved_path
    from ampaudit.core.console import make_console
    from ampaudit.watch.render import render_summary

    render_summary(monitor.summary(), make_console(sys.stderr))
    sys.stderr.write(f"ampaudit run: log written to {log}\n")
    return code
