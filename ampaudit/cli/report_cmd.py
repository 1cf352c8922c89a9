"""``ampaudit report LOG``: a watch log's summary, as text or JSON, or its findings in any
machine format of ``report/formats.py``; plots and TensorBoard scalars on request."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ampaudit.cli.common import EXIT_FINDINGS, EXIT_OK, path_type
from ampaudit.core.findings import FAIL_ON, Finding, Report, Target, fails_on
from ampaudit.report.formats import FORMATS

_SUMMARY_FORMATS = ("text", "json")  # the whole summary; every other format carries its findings only


def add_parser(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser("report", help="summarize an ampaudit watch log",
                            description="Summarize a watch log: per-module counts, then the run's findings (AMP6xx) "
                                        "in check's format.")
    report.add_argument("log", type=path_type)
    findings_only = " or ".join(f for f in FORMATS if f not in _SUMMARY_FORMATS)
    report.add_argument("--format", choices=FORMATS, default="text",
                        help=f"{' or '.join(_SUMMARY_FORMATS)}: the summary, findings last; {findings_only}: "
                             "the findings only (default: text)")
    report.add_argument("--fail-on", choices=FAIL_ON, default="error",
                        help="lowest finding severity that makes the exit code 1 (default: error)")
    report.add_argument("--plot", type=path_type, metavar="PNG", help="also plot histograms and over/underflow")
    report.add_argument("--tensorboard", type=path_type, metavar="DIR",
                        help="also write per-step scalars (overflow, underflow, loss scale, ...) for TensorBoard")


def cmd_report(args: argparse.Namespace) -> int:
    from ampaudit.core.console import make_console
    from ampaudit.core.outputs import refuse_special_file, resolve_output
    from ampaudit.report.watch_plot import check_plot_path, plot
    from ampaudit.watch.log_file import open_log
    from ampaudit.watch.render import render_summary
    from ampaudit.watch.summary import read_log

    refuse_special_file(args.log, "the log")
    if args.plot is not None:
        check_plot_path(args.plot)
        args.plot = resolve_output(args.plot, "--plot", inputs=[args.log])
    if args.tensorboard is not None:
        args.tensorboard = resolve_output(args.tensorboard, "--tensorboard", inputs=[args.log], folder=True).target
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
    findings = [Finding.from_dict(f) for f in summary["findings"]]
    return EXIT_FINDINGS if fails_on(findings, args.fail_on) else EXIT_OK


def watch_report(summary: dict, log: Path) -> Report:
    """A watch summary's findings as a check Report, for the machine formats and --fail-on."""
    return Report(Target(str(log), "ampaudit watch log", "none"), summary["dtype"],
                  findings=[Finding.from_dict(f) for f in summary["findings"]])
