"""``ampaudit`` entry point: the parser, one subcommand per module (``*_cmd.py``), and how an
error ends. Heavy imports (torch, rich) happen inside the commands, so ``ampaudit --help`` and
``--version`` stay fast, and everything but check's model audit, ``convert`` and ``run`` works
without torch (``pip install ampaudit`` alone: the lint).

Exit codes, like ruff: 0 no finding at or above --fail-on, 1 findings, 2 usage or load error.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

from ampaudit._version import __version__
from ampaudit.cli import catalog_cmd, check_cmd, convert_cmd, report_cmd, run_cmd
from ampaudit.cli.common import EXIT_ERROR
from ampaudit.core.errors import AmpauditError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # usage errors: one line, exit 2 (argparse's default too)
        self.exit(EXIT_ERROR, f"ampaudit: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ampaudit", description="Precision auditing for PyTorch mixed-precision (AMP) training.")
    parser.add_argument("--version", action="version", version=f"ampaudit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    check_cmd.add_parser(sub)
    convert_cmd.add_parser(sub)
    run_cmd.add_parser(sub)
    report_cmd.add_parser(sub)
    catalog_cmd.add_parsers(sub)
    return parser


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "check": check_cmd.cmd_check, "convert": convert_cmd.cmd_convert, "run": run_cmd.cmd_run,
    "report": report_cmd.cmd_report, "rules": catalog_cmd.cmd_rules, "explain": catalog_cmd.cmd_explain,
    "ops": catalog_cmd.cmd_ops,
}


class Terminated(BaseException):
    """SIGTERM, raised where the process is, so that temporary files and folders are removed."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def _paths_not_options(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``check``'s arguments with every existing file whose name starts with "-" (and is not
    one of check's options) written as ``./NAME``: a file ``-ofoo.py`` passed by pre-commit is
    a path to lint, not ``-o foo.py``."""
    if not argv or argv[0] != "check":
        return argv
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = {o for action in commands.choices["check"]._actions for o in action.option_strings}
    out = [argv[0]]
    for i, arg in enumerate(argv[1:], 1):
        if arg == "--":
            return out + argv[i:]
        is_path = arg.startswith("-") and arg not in options and arg != "-" and os.path.lexists(arg)
        out.append(f"./{arg}" if is_path else arg)
    return out


def _encodable_output() -> None:
    """A terminal or pipe whose encoding cannot hold the report's characters (``LC_ALL=C``,
    ``PYTHONIOENCODING=ascii``) gets them replaced, rather than losing the report to an error."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, LookupError, TypeError):  # captured, closed, None
            if codecs.lookup(stream.encoding).name not in ("utf-8", "utf-16", "utf-32", "gb18030"):
                stream.reconfigure(errors="replace")


def main(argv: Sequence[str] | None = None) -> int:
    _encodable_output()
    parser = build_parser()
    argv = _paths_not_options(list(sys.argv[1:] if argv is None else argv), parser)
    script_args = None
    if argv[:1] == ["run"]:
        argv, script_args = run_cmd.split_script_args(argv)
    args = parser.parse_args(argv)
    if script_args is not None:
        args.args = script_args
    if args.command is None:  # a usage error: the help goes where errors go
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    debug = getattr(args, "debug", False)
    with _signals(args.command):
        return _run(args, debug)


@contextlib.contextmanager
def _signals(command: str) -> Iterator[None]:
    """Over ``ulimit -f`` a write fails with EFBIG (said in one line) instead of killing the
    process; SIGTERM unwinds, so temporary files go (``run`` leaves it to the training script)."""
    wanted = {}
    if hasattr(signal, "SIGXFSZ"):
        wanted[signal.SIGXFSZ] = signal.SIG_IGN
    if command != "run":
        wanted[signal.SIGTERM] = _terminate
    if threading.current_thread() is not threading.main_thread():
        wanted = {}
    saved = {signum: signal.signal(signum, handler) for signum, handler in wanted.items()}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def _run(args: argparse.Namespace, debug: bool) -> int:
    try:
        os.getcwd()
    except OSError:  # torch's own libraries fail to load from a deleted folder, with no ampaudit line
        sys.stderr.write("ampaudit: error: the working folder was deleted: cd to an existing folder\n")
        return EXIT_ERROR
    try:
        return COMMANDS[args.command](args)
    except Terminated:
        sys.stderr.write("ampaudit: terminated\n")
        return 143
    except AmpauditError as exc:
        if debug:
            import traceback

            remote = getattr(exc, "remote_traceback", "")  # raised in the child process (core/child.py)
            sys.stderr.write(remote) if remote else traceback.print_exception(exc.__cause__ or exc)
        sys.stderr.write(f"ampaudit: error: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt as exc:
        if getattr(exc, "from_script", False):  # `run`: the script's Ctrl-C ends the process as python's would
            raise
        sys.stderr.write("ampaudit: interrupted\n")
        return 130
    except OSError as exc:  # a file the command could not use (a name too long, a folder gone, a full disk)
        where = f"{exc.filename}: " if exc.filename is not None else ""
        sys.stderr.write(f"ampaudit: error: {where}{exc.strerror or exc or type(exc).__name__}\n")
        return EXIT_ERROR
    except BaseException as exc:  # a bug in ampaudit, or user code that failed or called exit()
        if isinstance(exc, SystemExit) and args.command not in ("check", "convert"):
            raise  # no model code runs there: rich's exit on a closed pipe (`| head`), say - its code stands
        if debug:
            import traceback

            traceback.print_exception(exc)
        if isinstance(exc, SystemExit):  # check and convert never exit(): the model's code did
            cause = f"the model's code called exit({exc.code!r})"
        else:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""  # one line, always
            cause = f"unexpected {type(exc).__name__}: {text}" if text else f"unexpected {type(exc).__name__}"
        sys.stderr.write(f"ampaudit: error: {cause}{'' if debug else ' (run with --debug for the traceback)'}\n")
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
