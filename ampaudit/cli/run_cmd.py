"""``ampaudit run``: one flag per ``WatchOptions`` field that has one (watch/options.py), and
the script run with watch attached (``run_script.py``)."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import Field, fields
from pathlib import Path

from ampaudit.cli.common import number_type, path_type
from ampaudit.core.errors import UsageError
from ampaudit.watch.launch import launched  # torch-free, as --help must be
from ampaudit.watch.options import WatchOptions


def add_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="run a training script with ampaudit watch attached",
                         description="Run SCRIPT as __main__ with its arguments, recording per-module statistics "
                                     "of every module that runs forward and every optimizer that steps.")
    _add_watch_options(run)
    run.add_argument("script", type=_typed)  # as typed: the script's sys.argv[0]
    run.add_argument("args", nargs=argparse.REMAINDER)  # what split_script_args leaves is used instead


def _typed(text: str) -> str:
    """The script's path exactly as typed (``./s.py``, which pathlib would make ``s.py``),
    checked as any path argument is."""
    path_type(text)
    return text


def split_script_args(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``["run", *options, SCRIPT]`` and SCRIPT's own arguments exactly as typed: argparse would
    drop the first ``--`` after SCRIPT (``run s.py -- --x a`` must give the script ``['--',
    '--x', 'a']``, as ``python s.py -- --x a`` does). (argv, None) when there is no SCRIPT."""
    takes_value = {name: named[1] for option in fields(WatchOptions) if (named := _flag(option)) is not None
                   for name in (named[0], *option.metadata["flag"].aliases)}
    takes_value |= {"-h": False, "--help": False}
    i = 1
    while i < len(argv):
        word = argv[i]
        if word == "--":
            i += 1
            break
        if not word.startswith("-") or word == "-":
            break
        name = word.split("=", 1)[0]
        known = [o for o in takes_value if o == name or (name.startswith("--") and o.startswith(name))]
        option = name if name in takes_value else known[0] if len(known) == 1 else None  # argparse's abbreviations
        i += 2 if option is not None and takes_value[option] and "=" not in word else 1
    if i >= len(argv):
        return argv, None
    return argv[:i + 1], argv[i + 1:]


def _flag(option: Field) -> tuple[str, bool] | None:
    """A ``WatchOptions`` field's flag and whether it takes a value; None if it has none. A
    boolean is a switch: ``--name``, or ``--no-name`` for an option on by default."""
    if option.metadata["flag"] is None:
        return None
    name = option.name.replace("_", "-")
    if isinstance(option.default, bool):
        return (f"--no-{name}" if option.default else f"--{name}"), False
    return f"--{name}", True


def _add_watch_options(run: argparse.ArgumentParser) -> None:
    """A flag per ``WatchOptions`` field that has one, its ``dest`` the field's name."""
    for option in fields(WatchOptions):
        named = _flag(option)
        if named is None:
            continue
        flag, text = option.metadata["flag"], option.metadata["flag"].help or option.metadata["doc"]
        if not named[1]:
            run.add_argument(named[0], *flag.aliases, dest=option.name,
                             action="store_false" if option.default else "store_true", help=text)
            continue
        kwargs = {"default": flag.default if flag.default is not None else option.default, "metavar": flag.metavar,
                  "choices": flag.choices}
        if flag.requires:  # None when not given: watch_options() fills the default, cmd_run checks the pair
            kwargs["default"] = None
        if flag.least is not None:
            what = f"a whole number >= {flag.least}" if flag.most is None else \
                f"a whole number from {flag.least} to {flag.most}"
            kwargs["type"] = number_type(int, least=flag.least, most=flag.most or math.inf, what=what)
        if flag.path:
            kwargs["type"] = path_type
        if flag.repeat:
            kwargs.update(action="append", default=[])
            text += "; repeatable"
        run.add_argument(named[0], *flag.aliases, dest=option.name, help=text, **kwargs)


def watch_options(args: argparse.Namespace) -> WatchOptions:
    """The ``WatchOptions`` of ``ampaudit run``'s parsed flags."""
    given = {o.name: getattr(args, o.name) for o in fields(WatchOptions) if o.metadata["flag"]}
    return WatchOptions(**{name: value for name, value in given.items() if value is not None})


def _check_requires(args: argparse.Namespace) -> None:
    """``--fp8-history`` without ``--fp8`` did nothing, silently."""
    for option in fields(WatchOptions):
        flag = option.metadata["flag"]
        if flag is not None and flag.requires and getattr(args, option.name) is not None \
                and not getattr(args, flag.requires):
            name, needed = option.name.replace("_", "-"), flag.requires.replace("_", "-")
            raise UsageError(f"--{name} goes with --{needed}")


def _launched_rank() -> tuple[int, int] | None:
    """(rank, world size) of a rank other than 0 in a distributed launch, else None. The
    process group is not up when run opens the log, so watch cannot ask it."""
    place = launched()
    return place if place is not None and place[0] > 0 else None


def cmd_run(args: argparse.Namespace) -> int:
    from ampaudit.core.outputs import refuse_special_file, resolve_output
    from ampaudit.core.torch_extra import require_torch

    require_torch("ampaudit run")
    from ampaudit.cli.run_script import run_script, say_without_log
    from ampaudit.watch import compiled

    if args.inside_compile and not compiled.SUPPORTED:
        raise UsageError("--inside-compile needs torch's effect tokens, which this torch does not have: update "
                         "torch, or run without it")

    _check_requires(args)
    script = Path(args.script)
    refuse_special_file(script, "the script")
    # the default log, not asked for: where it cannot be written the script trains without one
    optional = args.log is next(f for f in fields(WatchOptions) if f.name == "log").metadata["flag"].default
    launched = _launched_rank()
    if launched is not None and args.log is not None:  # a rank refused the log would never join the others
        sys.stderr.write(f"ampaudit run: rank {launched[0]} of {launched[1]}: the log is rank 0's: watching "
                         "without one\n")
        args.log = None
    if args.log is not None:  # resolved before the script runs (it may chdir)
        try:
            log = resolve_output(args.log, "--log", inputs=[script])
        except UsageError as exc:
            if not optional:
                raise
            say_without_log(exc)
            args.log = None
        else:
            log.close()  # the watch opens the log itself, resolving it again
            args.log = log.target
    return run_script(script, [args.script, *args.args], watch_options(args), optional_log=optional)
