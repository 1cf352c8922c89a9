"""``ampaudit`` entry point. Heavy imports (torch, rich) happen inside the commands, so
``ampaudit --help`` and ``--version`` stay fast, and everything but check's model audit,
``convert`` and ``run`` works without torch (``pip install ampaudit`` alone: the lint).

Exit codes, like ruff: 0 no finding at or above --fail-on, 1 findings, 2 usage or load error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from ampaudit._version import __version__
from ampaudit.core.dtypes import LOW_DTYPES
from ampaudit.core.errors import AmpauditError, UsageError
from ampaudit.core.findings import Severity
from ampaudit.load.time_limit import DEFAULT_SECONDS  # torch-free, as --help must be
from ampaudit.watch.options import WatchOptions  # torch-free too

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
FORMATS = ("text", "json", "sarif", "github")


def _number(kind: type, *, least: float, what: str):
    """An argparse type: a finite number of ``kind`` that is at least ``least``."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value != value or value in (float("inf"), float("-inf")) or value < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    return parse


def _path(text: str) -> Path:
    """A path argument; an empty one would silently mean the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: name a file or folder")
    return Path(text)


_SECONDS = _number(float, least=0, what="a number of seconds >= 0")
_TOLERANCE = _number(float, least=0, what="a finite relative error >= 0")
_STEPS = _number(int, least=0, what="a whole number >= 0")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # usage errors: one line, exit 2 (argparse's default too)
        self.exit(EXIT_ERROR, f"ampaudit: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ampaudit", description="Precision auditing for PyTorch mixed-precision (AMP) training.")
    parser.add_argument("--version", action="version", version=f"ampaudit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

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
    check.add_argument("-o", "--output", type=_path, help="write the report to this file instead of stdout")
    check.add_argument("--dtype", choices=LOW_DTYPES, help="target low-precision dtype "
                       "(default: float16, or [tool.ampaudit] dtype)")
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
    check.add_argument("--import-timeout", type=_SECONDS, default=DEFAULT_SECONDS, metavar="SECONDS",
                       help="stop importing the model file and building its model after this long "
                            f"(default {DEFAULT_SECONDS:g}; 0: no limit)")
    check.add_argument("--policy", action="append", default=[], type=Path, metavar="FILE",
                       help="TOML file extending or overriding the op catalog (ops.toml schema); repeatable")
    check.add_argument("--select", action="append", default=[], metavar="CODES",
                       help="only report these rule codes or prefixes (comma-separated)")
    check.add_argument("--ignore", action="append", default=[], metavar="CODES",
                       help="do not report these rule codes or prefixes (comma-separated)")
    check.add_argument("--fail-on", choices=("error", "warning", "info", "never"),
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

    conv = sub.add_parser("convert", help="rewrite a model into explicit mixed precision",
                          description="Convert the model in PATH to fp16/bf16 compute with fp32 where needed, verify "
                                      "it against fp32, and write a standalone module, its weights and plan.json.")
    conv.add_argument("target", metavar="PATH[:NAME]",
                      help="model file (entry points as for `check`), module.path:NAME_OR_EXPR or hf:MODEL_TYPE")
    conv.add_argument("-o", "--output", type=_path, required=True, metavar="OUT_DIR", help="folder to write to")
    conv.add_argument("--dtype", choices=LOW_DTYPES, default="float16")
    conv.add_argument("--no-verify", action="store_true", help="do not compare with fp32 or promote ops")
    conv.add_argument("--tolerance", type=_TOLERANCE,
                      help="relative output error allowed (default 1e-2 fp16, 5e-2 bf16)")
    conv.add_argument("--emit", action="append", default=[], choices=("autocast", "hf", "fsdp2"), metavar="FORMAT",
                      help="also write the plan as a policy for other tools: autocast (modules to run in fp32 "
                           "under torch.autocast), hf (_keep_in_fp32_modules), fsdp2 (MixedPrecisionPolicy per "
                           "module); repeatable")
    conv.add_argument("--backend", choices=("auto", "fx", "modules"), default="auto",
                      help="fx: rewrite the traced graph; modules: keep the model's own forward and apply the plan "
                           "per module (any model); auto (default): fx where the model traces, else modules")
    conv.add_argument("--weights", choices=("low", "fp32"), default="low",
                      help="low (default): store low-precision modules' weights low (half their bytes; fp32 masters "
                           "when trained); fp32: keep every weight fp32 and cast it at each use, as autocast does - "
                           "what ampaudit.convert(model, optimizer) does by default (autocast's training memory)")
    conv.add_argument("--train-steps", type=_STEPS, default=20, metavar="N",
                      help="also verify by training: N AdamW steps of copies of the converted and the fp32 model, "
                           "loss by loss (default 20; 0: off)")
    conv.add_argument("--constants", choices=("fp32", "clamp"), default="fp32",
                      help="ops with constants the dtype cannot hold: keep in fp32 (default) or clamp the constant")
    conv.add_argument("--input-shape", action="append", default=[], metavar="SHAPE")
    conv.add_argument("--input-dtype", action="append", default=[], metavar="DTYPE")
    conv.add_argument("--config", action="append", default=[], metavar="KEY=VALUE", dest="model_config",
                      help="for hf:MODEL_TYPE, set a field of the model's config (repeatable)")
    conv.add_argument("--exec", dest="allow_exec", action="store_true")
    conv.add_argument("--import-timeout", type=_SECONDS, default=DEFAULT_SECONDS, metavar="SECONDS",
                      help=f"as for check (default {DEFAULT_SECONDS:g}; 0: no limit)")
    conv.add_argument("--force", action="store_true",
                      help="write into a non-empty OUT_DIR that holds no earlier ampaudit export")
    conv.add_argument("--debug", action="store_true", help="show tracebacks for errors")

    run = sub.add_parser("run", help="run a training script with ampaudit watch attached",
                         description="Run SCRIPT as __main__ with its arguments, recording per-module statistics "
                                     "of every module that runs forward and every optimizer that steps.")
    _add_watch_options(run)
    run.add_argument("script", type=Path)
    run.add_argument("args", nargs=argparse.REMAINDER)
    report = sub.add_parser("report", help="summarize an ampaudit watch log",
                            description="Summarize a watch log: per-module counts, then the run's findings (AMP6xx) "
                                        "in check's format.")
    report.add_argument("log", type=Path)
    report.add_argument("--format", choices=FORMATS, default="text",
                        help="text or json: the summary, findings last; sarif or github: the findings only "
                             "(default: text)")
    report.add_argument("--fail-on", choices=("error", "warning", "info", "never"), default="error",
                        help="lowest finding severity that makes the exit code 1 (default: error)")
    report.add_argument("--plot", type=_path, metavar="PNG", help="also plot histograms and over/underflow")
    report.add_argument("--tensorboard", type=_path, metavar="DIR",
                        help="also write per-step scalars (overflow, underflow, loss scale, ...) for TensorBoard")

    rules = sub.add_parser("rules", help="list the rules")
    rules.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    explain = sub.add_parser("explain", help="show a rule's documentation")
    explain.add_argument("code", help="rule code, e.g. AMP101")
    ops = sub.add_parser("ops", help="show the op-precision catalog (with your policy applied)",
                         description="List catalog entries whose kind, module type or alias contains PATTERN.")
    ops.add_argument("pattern", nargs="?", default="", help="substring of an op kind, alias or module type")
    ops.add_argument("--format", choices=("text", "json"), default="text")
    ops.add_argument("--policy", action="append", default=[], type=Path, metavar="FILE",
                     help="apply this policy file first (repeatable)")
    return parser


def _refuse_overwriting_inputs(output: Path | None, inputs, flag: str) -> None:
    """An output path that names one of the command's inputs would destroy it: refuse."""
    if output is None:
        return
    from ampaudit.core.files import same_file

    for path in inputs:
        if path is not None and Path(path).is_file() and Path(output).exists() and same_file(output, path):
            raise UsageError(f"{flag} {output} is an input of this command ({path}): refusing to overwrite it")


def _emit(text: str, output: Path | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    from ampaudit.core.files import write_atomic

    write_atomic(output, text)


def cmd_check(args: argparse.Namespace) -> int:
    from ampaudit.check.options import CheckOptions
    from ampaudit.check.run import check_targets
    from ampaudit.core.config import check_prefixes, load_config
    from ampaudit.core.streams import user_output_to_stderr
    from ampaudit.load.spec import parse_spec

    first = parse_spec(args.targets[0])
    config = load_config(first.path if first.kind == "file" and first.path.exists() else
                         Path.cwd() if first.kind != "file" else None)
    if args.select:
        config.select = check_prefixes(args.select, "--select")
    config.ignore += check_prefixes(args.ignore, "--ignore")
    if args.fail_on:
        config.fail_on = args.fail_on
    inputs = [parse_spec(t).path for t in args.targets] + list(args.policy) + [config.source]
    _refuse_overwriting_inputs(args.output, inputs, "-o")
    options = CheckOptions(dtype=args.dtype, allow_exec=args.allow_exec, input_shapes=args.input_shape,
                           input_dtypes=args.input_dtype, model_config=args.model_config,
                           policy_files=args.policy, run=not args.no_run, import_timeout=args.import_timeout,
                           lint_only=args.lint_only, exclude=args.exclude, progress=_progress_bar)

    def run():
        with user_output_to_stderr():  # the user's model code may print: stdout is the report's
            return check_targets(args.targets, config, options)

    report = run()
    if args.fix or args.diff:
        from ampaudit.check.fix import fix_files, fixable

        results = fix_files(report.findings, unsafe=args.unsafe_fixes, write=not args.diff)
        count = sum(len(r.fixed) for r in results)
        if args.diff:
            sys.stdout.write("".join(r.diff for r in results))
            sys.stderr.write(f"{count} fix{'es' if count != 1 else ''} would be applied to {len(results)} file(s)\n")
            return EXIT_FINDINGS if results else EXIT_OK
        sys.stderr.write(f"Fixed {count} finding{'s' if count != 1 else ''} in {len(results)} file(s).\n")
        if results:
            report = run()  # what is left, on the rewritten files
        hidden = len(fixable(report.findings, unsafe=True)) - len(fixable(report.findings, unsafe=False))
        if hidden and not args.unsafe_fixes:
            sys.stderr.write(f"{hidden} more fixable with --unsafe-fixes.\n")
    _render(report, args)
    return EXIT_FINDINGS if config.fails(report) else EXIT_OK


def _render(report, args: argparse.Namespace) -> None:
    if args.format == "text":
        from ampaudit.core.console import make_console
        from ampaudit.report.terminal import render

        if args.output is not None:
            import io

            buffer = io.StringIO()
            render(report, make_console(buffer, width=120), show_ops=args.show_ops)
            _emit(buffer.getvalue(), args.output)
        else:
            render(report, make_console(), show_ops=args.show_ops)
    else:
        from ampaudit.report.formats import render_machine

        _emit(render_machine(report, args.format), args.output)


def _progress_bar(total: int):
    """A progress bar on stderr while many files are linted (only on a terminal)."""
    if not sys.stderr.isatty():
        return lambda: None
    from rich.progress import Progress

    progress = Progress(transient=True, console=__import__("rich.console").console.Console(stderr=True))
    task = progress.add_task("linting", total=total)
    progress.start()
    done = [0]

    def tick() -> None:
        done[0] += 1
        progress.advance(task)
        if done[0] >= total:
            progress.stop()

    return tick


def cmd_rules(args: argparse.Namespace) -> int:
    from ampaudit.core.rulebook import rulebook

    rules = list(rulebook().values())
    if args.format == "markdown":
        from ampaudit.report.rule_docs import rules_markdown

        sys.stdout.write(rules_markdown(rules))
    elif args.format == "json":
        import json

        data = [{"code": r.code, "name": r.name, "severity": r.severity.value, "family": r.family,
                 "message": r.message} for r in rules]
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        from rich.table import Table

        from ampaudit.core.console import make_console

        table = Table(title="ampaudit rules", title_justify="left")
        for col in ("code", "name", "severity", "what it finds"):
            table.add_column(col, overflow="fold")
        for r in rules:
            table.add_row(r.code, r.name, r.severity.value, r.what.split(". ")[0].rstrip(".") + ".")
        make_console().print(table)
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    from ampaudit.core.rulebook import rulebook

    code = args.code.strip().upper()
    rule = rulebook().get(code)
    if rule is None:
        raise UsageError(f"unknown rule {args.code!r} (`ampaudit rules` lists them)")
    from rich.markdown import Markdown

    from ampaudit.core.console import make_console
    from ampaudit.report.rule_docs import rule_markdown

    console = make_console()
    if console.is_terminal:
        console.print(Markdown(rule_markdown(rule)))
    else:
        sys.stdout.write(rule_markdown(rule))
    return EXIT_OK


def cmd_ops(args: argparse.Namespace) -> int:
    from ampaudit.core.catalog import build_catalog
    from ampaudit.core.config import load_config

    catalog = build_catalog(load_config(Path.cwd()), policy_files=args.policy)
    needle = args.pattern.lower()
    names: dict[str, list[str]] = {kind: [] for kind in catalog.ops}
    for alias, kind in catalog.aliases.items():
        names.setdefault(kind, []).append(alias)
    for module, kind in catalog.modules.items():
        names.setdefault(kind, []).append(module)
    hits = sorted(k for k, extra in names.items()
                  if k in catalog.ops and (needle in k or any(needle in e.lower() for e in extra)))
    if not hits:
        raise UsageError(f"no catalog entry matches {args.pattern!r}")
    if args.format == "json":
        import json

        data = [{"kind": k, "precision": p.precision.value, "autocast": p.autocast, "reason": p.reason,
                 "source": p.source, "also": sorted(names[k])} for k in hits for p in [catalog.ops[k]]]
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return EXIT_OK
    from rich.table import Table
    from rich.text import Text

    from ampaudit.core.console import make_console

    table = Table(title=f"op catalog: {len(hits)} of {len(catalog.ops)} kinds", title_justify="left")
    for col in ("kind", "precision", "autocast"):
        table.add_column(col, no_wrap=True)
    table.add_column("reason / source / also matched by", overflow="fold", ratio=1)
    for kind in hits:
        p = catalog.ops[kind]
        also = ", ".join(sorted(names[kind]))
        detail = Text(p.reason + "\n")
        detail.append(p.source + (f"; {also}" if also else ""), style="dim")
        table.add_row(kind, p.precision.value, p.autocast, detail)
    make_console().print(table)
    return EXIT_OK


def cmd_convert(args: argparse.Namespace) -> int:
    from ampaudit.core.torch_extra import require_torch

    require_torch("ampaudit convert", ("torch", "safetensors"))  # one line naming the install, exit 2
    import torch

    from ampaudit.convert.api import DEFAULT_TOLERANCE, convert
    from ampaudit.convert.export import check_export_folder, export
    from ampaudit.core.console import make_console, slow_status
    from ampaudit.core.findings import Target
    from ampaudit.core.streams import user_output_to_stderr
    from ampaudit.load.loader import NotImported, load_target
    from ampaudit.load.spec import parse_spec
    from ampaudit.report.conversion import render_conversion

    model_file = parse_spec(args.target).path
    check_export_folder(args.output, force=args.force, inputs=[model_file] if model_file else [])  # before the work
    with user_output_to_stderr():
        loaded = load_target(args.target, allow_exec=args.allow_exec, input_shapes=args.input_shape,
                             input_dtypes=args.input_dtype, model_config=args.model_config,
                             import_timeout=args.import_timeout)
        if isinstance(loaded, NotImported):
            raise UsageError(f"{loaded.path} was not imported: {loaded.what} at line {loaded.line} would run on "
                             "import (pass --exec to import it anyway)")
        trains = args.train_steps > 0 and loaded.inputs is not None and not args.no_verify
        progress = slow_status("converting: tracing, deciding, verifying against fp32"
                               + (f", {args.train_steps} training steps" if trains else ""))
        # the training check needs an optimizer: AdamW, the usual one (its copies train; this one is not used)
        optimizer = torch.optim.AdamW(loaded.model.parameters(), lr=1e-3) if trains else None
        with progress:
            result = convert(loaded.model, optimizer, example_inputs=loaded.inputs, dtype=args.dtype,
                             verify=not args.no_verify, constants=args.constants, tolerance=args.tolerance,
                             train_steps=args.train_steps, backend=args.backend, weights=args.weights)
        model_mp = result[0] if optimizer is not None else result
    summary = model_mp.summary.to_dict()
    files = export(model_mp, args.output, summary=summary, force=args.force,
                   inputs=[model_file] if model_file else [], emit=dict.fromkeys(args.emit))
    render_conversion(summary, Target(loaded.label, loaded.entry, "fx"), [str(f) for f in files],
                      make_console())
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE[args.dtype]
    after = summary["error_after"]
    trained = summary["train"]
    missed = (after is not None and after > tolerance) or (trained is not None and not trained["passed"])
    return EXIT_FINDINGS if missed else EXIT_OK


def _add_watch_options(run: argparse.ArgumentParser) -> None:
    """``ampaudit run``'s flags: one per ``WatchOptions`` field that has one (watch/options.py),
    its ``dest`` the field's name."""
    for option in fields(WatchOptions):
        flag, name = option.metadata["flag"], option.name.replace("_", "-")
        if flag is None:
            continue
        text = flag.help or option.metadata["doc"]
        if isinstance(option.default, bool):  # a switch: on, or off for an option on by default
            run.add_argument(f"--no-{name}" if option.default else f"--{name}", dest=option.name,
                             action="store_false" if option.default else "store_true", help=text)
            continue
        kwargs = {"default": flag.default if flag.default is not None else option.default, "metavar": flag.metavar,
                  "choices": flag.choices}
        if flag.least is not None:
            kwargs["type"] = _number(int, least=flag.least, what=f"a whole number >= {flag.least}")
        if flag.path:
            kwargs["type"] = _path
        if flag.repeat:
            kwargs.update(action="append", default=[])
            text += "; repeatable"
        run.add_argument(f"--{name}", dest=option.name, help=text, **kwargs)


def watch_options(args: argparse.Namespace) -> WatchOptions:
    """The ``WatchOptions`` of ``ampaudit run``'s parsed flags."""
    return WatchOptions(**{o.name: getattr(args, o.name) for o in fields(WatchOptions) if o.metadata["flag"]})


def cmd_run(args: argparse.Namespace) -> int:
    from ampaudit.core.torch_extra import require_torch

    require_torch("ampaudit run")
    from ampaudit.cli.run_script import run_script
    from ampaudit.watch import compiled

    if args.inside_compile and not compiled.SUPPORTED:
        raise UsageError("--inside-compile needs torch's effect tokens, which this torch does not have: update "
                         "torch, or run without it")

    _refuse_overwriting_inputs(args.log, [args.script], "--log")
    return run_script(args.script, args.args, watch_options(args))


def cmd_report(args: argparse.Namespace) -> int:
    from ampaudit.core.console import make_console
    from ampaudit.report.watch_plot import check_plot_path, plot
    from ampaudit.watch.log_file import open_log
    from ampaudit.watch.render import render_summary
    from ampaudit.watch.summary import read_log

    _refuse_overwriting_inputs(args.plot, [args.log], "--plot")
    if args.plot is not None:
        check_plot_path(args.plot)
    summary = read_log(args.log).summary()  # streamed; the plots read the log again, also streamed
    if args.plot is not None:
        plot(open_log(args.log, steps_only=True)[1], summary, args.plot)
    if args.tensorboard is not None:
        from ampaudit.report.tensorboard import write_tensorboard

        points = write_tensorboard(open_log(args.log, steps_only=True)[1], args.tensorboard)
        print(f"wrote {points} scalars over {summary['steps']} steps to {args.tensorboard}", file=sys.stderr)
    if args.format == "json":
        from ampaudit.report.formats import strict_json

        sys.stdout.write(strict_json(summary))
    elif args.format == "text":
        render_summary(summary, make_console())
    else:
        from ampaudit.report.formats import render_machine

        sys.stdout.write(render_machine(watch_report(summary, args.log), args.format))
    findings = summary["findings"]
    if args.fail_on != "never" and any(Severity.parse(f["severity"]).rank >= Severity(args.fail_on).rank
                                       for f in findings):
        return EXIT_FINDINGS
    return EXIT_OK


def watch_report(summary: dict, log: Path):
    """A watch summary's findings as a check Report, for the SARIF and GitHub renderers."""
    from ampaudit.core.findings import Finding, Report, Target

    return Report(Target(str(log), "ampaudit watch log", "none"), summary["dtype"],
                  findings=[Finding.from_dict(f) for f in summary["findings"]])


COMMANDS = {
    "check": cmd_check, "convert": cmd_convert, "run": cmd_run, "report": cmd_report,
    "rules": cmd_rules, "explain": cmd_explain, "ops": cmd_ops,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_ERROR
    debug = getattr(args, "debug", False)
    try:
        return COMMANDS[args.command](args)
    except AmpauditError as exc:
        if debug:
            import traceback

            traceback.print_exception(exc.__cause__ or exc)
        sys.stderr.write(f"ampaudit: error: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("ampaudit: interrupted\n")
        return 130
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
