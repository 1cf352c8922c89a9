"""``ampaudit check``: its flags, and the report of ``check/`` rendered in the chosen format."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from ampaudit.cli.common import EXIT_FINDINGS, EXIT_OK, SECONDS, emit, path_type
from ampaudit.core.dtypes import FP8_RECIPES, LOW_DTYPES
from ampaudit.core.errors import UsageError
from ampaudit.core.findings import FAIL_ON, Report
from ampaudit.load.time_limit import DEFAULT_SECONDS  # torch-free, as --help must be
from ampaudit.report.formats import FORMATS


def add_parser(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser("check", help="audit a model or training script before enabling AMP",
                           description="Lint PATH's source for AMP protocol bugs and, when PATH is one model file, "
                                       "trace the model, classify every op for mixed precision and report what "
                                       "needs fp32, at your source lines.")
    check.add_argument("targets", metavar="PATH[:NAME]", nargs="+",
                       help="Python files or folders; for one model file, NAME picks an nn.Module instance, a "
                            "no-arg class or a zero-arg factory, or an expression builds it "
                            "(model.py:\"GPT(GPTConfig(n_layer=2))\"); a model alone: module.path:NAME_OR_EXPR "
                            "(torch.nn:\"Linear(4, 4)\") or hf:MODEL_TYPE (hf:gpt2)")
    check.add_argument("--format", choices=FORMATS, default="text", help="output format (default: text)")
    check.add_argument("-o", "--output", type=path_type, help="write the report to this file instead of stdout")
    check.add_argument("--dtype", choices=(*LOW_DTYPES, "fp8"), help="target low-precision dtype "
                       "(default: float16, or [tool.ampaudit] dtype); fp8: which nn.Linear layers can train in "
                       "float8 (torchao's recipes, emulated), measured on the example inputs")
    check.add_argument("--fp8-recipe", choices=FP8_RECIPES, help="with --dtype fp8: the recipe judged "
                       "(default: tensorwise; the table shows every recipe's SQNR)")
    check.add_argument("--input-shape", action="append", default=[], metavar="SHAPE",
                       help="example input shape such as 8,3,32,32; repeat once per positional argument")
    check.add_argument("--input-dtype", action="append", default=[], metavar="DTYPE",
                       help="dtype of the --input-shape tensors (default float32; one, or one per shape)")
    check.add_argument("--config", action="append", default=[], metavar="KEY=VALUE", dest="model_config",
                       help="for hf:MODEL_TYPE, set a field of the model's config (repeatable): --config n_layer=4")
    check.add_argument("--no-run", action="store_true",
                       help="never execute the model: no value ranges, no recorder fallback")
    check.add_argument("--exec", dest="allow_exec", action="store_true",
                       help="import the file even if its top level runs code (loops, calls)")
    check.add_argument("--import-timeout", type=SECONDS, default=DEFAULT_SECONDS, metavar="SECONDS",
                       help="stop importing the model file and building its model after this long "
                            f"(default {DEFAULT_SECONDS:g}; 0: no limit)")
    check.add_argument("--policy", action="append", default=[], type=path_type, metavar="FILE",
                       help="TOML file extending or overriding the op catalog (ops.toml schema); repeatable")
    check.add_argument("--select", action="append", default=[], metavar="CODES",
                       help="only report these rule codes or prefixes (comma-separated)")
    check.add_argument("--ignore", action="append", default=[], metavar="CODES",
                       help="do not report these rule codes or prefixes (comma-separated)")
    check.add_argument("--fail-on", choices=FAIL_ON,
                       help="lowest severity that makes the exit code 1 (default: warning)")
    check.add_argument("--show-ops", action="store_true", help="also list every op with its precision")
    check.add_argument("--lint-only", action="store_true", help="only the training-script lint: no import, no graph")
    check.add_argument("--fix", action="store_true", help="apply safe fixes in place (atomic writes)")
    check.add_argument("--unsafe-fixes", action="store_true",
                       help="with --fix or --diff, also apply fixes that change what the code does")
    check.add_argument("--diff", action="store_true", help="print the fixes as a unified diff; write nothing")
    check.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                       help="skip files or folders matching GLOB when walking folders (repeatable)")
    check.add_argument("--debug", action="store_true", help="show tracebacks for errors")


def cmd_check(args: argparse.Namespace) -> int:
    from ampaudit.check.fix import fix_and_recheck, fix_files
    from ampaudit.check.options import CheckOptions
    from ampaudit.check.run import check_targets, config_for, target_files
    from ampaudit.core.config import check_prefixes
    from ampaudit.core.outputs import refuse_special_file, resolve_output
    from ampaudit.core.streams import user_output_to_stderr
    from ampaudit.load.spec import parse_spec

    if any(not t.strip() for t in args.targets):
        raise UsageError("an empty PATH (an unset variable?): name a file or folder")
    config = config_for(args.targets)
    if args.select:
        config.select = check_prefixes(args.select, "--select")
    config.ignore += check_prefixes(args.ignore, "--ignore")
    if args.fail_on:
        config.fail_on = args.fail_on
    for policy in args.policy:
        refuse_special_file(policy, "--policy")
    if args.output is not None:  # resolved now, before a model's code can chdir; never onto a file it reads
        walked = target_files([t for t in args.targets if parse_spec(t).kind == "file" and Path(t).is_dir()])
        inputs = [parse_spec(t).path for t in args.targets] + walked + list(args.policy) + [config.source]
        args.output = resolve_output(args.output, "-o", inputs=inputs)
    options = CheckOptions(dtype=args.dtype, fp8_recipe=args.fp8_recipe, allow_exec=args.allow_exec,
                           input_shapes=args.input_shape,
                           input_dtypes=args.input_dtype, model_config=args.model_config,
                           policy_files=args.policy, run=not args.no_run, import_timeout=args.import_timeout,
                           lint_only=args.lint_only, exclude=args.exclude, progress=_progress_bar,
                           isolate=True)
    if args.policy and args.lint_only:
        options.notes.append("--policy: read, and not used: the lint reads no op catalog")

    if args.fix and not args.diff:
        with user_output_to_stderr():  # the user's model code may print: stdout is the report's
            fixed = fix_and_recheck(args.targets, config, options, unsafe=args.unsafe_fixes)
        count = fixed.fixed
        sys.stderr.write(f"Fixed {count} finding{'s' if count != 1 else ''} in {len(fixed.files)} file(s).\n")
        if fixed.unsafe_left and not args.unsafe_fixes:
            sys.stderr.write(f"{fixed.unsafe_left} more fixable with --unsafe-fixes.\n")
        report = fixed.report
    else:
        with user_output_to_stderr():
            report = check_targets(args.targets, config, options)
        if args.diff:
            results = fix_files(report.findings, unsafe=args.unsafe_fixes, write=False)
            count = sum(len(r.fixed) for r in results)
            sys.stdout.write("".join(r.diff for r in results))
            sys.stderr.write(f"{count} fix{'es' if count != 1 else ''} would be applied to {len(results)} file(s)\n")
            return EXIT_FINDINGS if results else EXIT_OK
    _render(report, args)
    return EXIT_FINDINGS if config.fails(report) else EXIT_OK


def _render(report: Report, args: argparse.Namespace) -> None:
    if args.format == "text":
        from ampaudit.core.console import make_console
        from ampaudit.report.terminal import render

        if args.output is not None:
            import io

            buffer = io.StringIO()
            render(report, make_console(buffer, width=120), show_ops=args.show_ops)
            emit(buffer.getvalue(), args.output)
        else:
            render(report, make_console(), show_ops=args.show_ops)
    else:
        from ampaudit.report.formats import render_machine

        emit(render_machine(report, args.format), args.output)


def _progress_bar(total: int) -> Callable[[], None]:
    """A progress bar on stderr while many files are linted (only on a terminal)."""
    if not sys.stderr.isatty():
        return lambda: None
    from rich.console import Console
    from rich.progress import Progress

    progress = Progress(transient=True, console=Console(stderr=True))
    task = progress.add_task("linting", total=total)
    progress.start()
    done = [0]

    def tick() -> None:
        done[0] += 1
        progress.advance(task)
        if done[0] >= total:
            progress.stop()

    return tick
