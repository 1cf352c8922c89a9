"""``ampaudit rules``, ``explain CODE`` and ``ops [PATTERN]``: the rulebook and the op catalog,
rendered by ``report/rule_docs.py`` and ``report/op_table.py``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ampaudit.cli.common import EXIT_OK, path_type, show
from ampaudit.core.errors import UsageError
from ampaudit.report.op_table import OPS_FORMATS
from ampaudit.report.rule_docs import RULE_FORMATS


def add_parsers(sub: argparse._SubParsersAction) -> None:
    rules = sub.add_parser("rules", help="list the rules")
    rules.add_argument("--format", choices=tuple(RULE_FORMATS), default="text")
    explain = sub.add_parser("explain", help="show a rule's documentation")
    explain.add_argument("code", help="rule code, e.g. AMP101")
    ops = sub.add_parser("ops", help="show the op-precision catalog (with your policy applied)",
                         description="List catalog entries whose kind, module type or alias contains PATTERN.")
    ops.add_argument("pattern", nargs="?", default="", help="substring of an op kind, alias or module type")
    ops.add_argument("--format", choices=tuple(OPS_FORMATS), default="text")
    ops.add_argument("--policy", action="append", default=[], type=path_type, metavar="FILE",
                     help="apply this policy file first (repeatable)")


def cmd_rules(args: argparse.Namespace) -> int:
    from ampaudit.core.rulebook import rulebook

    show(RULE_FORMATS[args.format](list(rulebook().values())))
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    from ampaudit.core.rulebook import rulebook

    rule = rulebook().get(args.code.strip().upper())
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
    matches = catalog.search(args.pattern)
    if not matches:
        raise UsageError(f"no catalog entry matches {args.pattern!r}")
    show(OPS_FORMATS[args.format](matches, len(catalog.ops)))
    return EXIT_OK
