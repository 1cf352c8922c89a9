"""Apply the autofixes of reported findings: in place (atomically) or as a unified diff."""

from __future__ import annotations

import ast
import difflib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ampaudit.check.lint import edits
from ampaudit.check.options import CheckOptions
from ampaudit.check.run import check_targets, config_for
from ampaudit.core.config import Config
from ampaudit.core.errors import UsageError
from ampaudit.core.files import digest, locked, write_atomic
from ampaudit.core.findings import Finding, Report
from ampaudit.core.outputs import resolve_output
from ampaudit.core.python_source import read_python, run_deep


@dataclass
class FileFix:
    path: str
    fixed: list[Finding]  # the findings whose fix was applied
    diff: str


@dataclass
class FixRun:
    """What ``ampaudit check --fix`` did: the files it rewrote and the report checked after."""

    files: list[FileFix]
    report: Report  # the findings left: checked again when a file was rewritten

    @property
    def fixed(self) -> int:
        return sum(len(f.fixed) for f in self.files)

    @property
    def unsafe_left(self) -> int:
        """How many findings left only ``unsafe=True`` would fix."""
        return len(fixable(self.report.findings, unsafe=True)) - len(fixable(self.report.findings, unsafe=False))


def fixable(findings: Iterable[Finding], *, unsafe: bool) -> list[Finding]:
    return [f for f in findings if f.autofix is not None and (f.autofix.safe or unsafe)]


def fix_and_recheck(targets: Sequence[str], config: Config | None = None, options: CheckOptions | None = None,
                    *, unsafe: bool = False) -> FixRun:
    """``ampaudit check --fix TARGETS``: check ``targets``, apply the fixes of what is found in
    place (``unsafe``: also those that change behaviour), then check again for what is left.
    ``config``: by default the one ``ampaudit check`` would read (:func:`config_for`)."""
    config = config if config is not None else config_for(targets)
    options = options if options is not None else CheckOptions()
    report = check_targets(targets, config, options)
    files = fix_files(report.findings, unsafe=unsafe, write=True)
    if files:  # with nothing rewritten the first report stands: no second import of the model
        report = check_targets(targets, config, options)
    return FixRun(files, report)


def fix_files(findings: Iterable[Finding], *, unsafe: bool, write: bool) -> list[FileFix]:
    """Apply the fixes of ``findings`` (only those: never anything not reported)."""
    by_file: dict[str, list[Finding]] = defaultdict(list)
    for finding in fixable(findings, unsafe=unsafe):
        by_file[finding.file].append(finding)
    results, refused = [], []
    for file, chosen in sorted(by_file.items()):
        try:
            with locked(Path(file)):  # a second --fix on this file waits, then finds it changed
                result = _fix_one(file, chosen, write=write)
        except UsageError as error:  # this file stays as it is; the others are still fixed
            refused.append(str(error))
            continue
        if result is not None:
            results.append(result)
    if refused:  # one line that also names what was written, or a user would not know
        done = f" ({len(results)} other file(s) fixed: {', '.join(r.path for r in results)})" if results else ""
        raise UsageError("; ".join(refused) + done)
    return results


def _fix_one(file: str, chosen: list[Finding], *, write: bool) -> FileFix | None:
    before, encoding = read_python(Path(file))  # written back the same way: cookie, BOM
    read = digest(before)
    if any(f.autofix.source not in (None, read) for f in chosen):
        # the edits' offsets are for the text that was linted: never apply them to another
        raise UsageError(f"{file} changed since it was checked: nothing written (run the command again)")
    after, taken = edits.apply(before, (e for f in chosen for e in f.autofix.edits))
    taken_set = set(taken)
    fixed = [f for f in chosen if set(f.autofix.edits) <= taken_set]
    if after == before:
        return None
    if run_deep(_compiles, before) and not run_deep(_compiles, after):  # as deep as the lint parsed it
        # a fix that would break the file is a bug of ours: the user's file stays as it is
        rules = ", ".join(sorted({f.rule for f in chosen}))
        raise UsageError(f"{file}: the {rules} fix would leave it invalid Python (an ampaudit bug: please report "
                         f"it): nothing written")
    diff = unified_diff(before, after, file)
    if write:  # through links the user or root owns, as an output is (core/outputs.py)
        target = resolve_output(file, "--fix")
        try:
            write_atomic(target.target, after, expected=before, encoding=encoding, follow_links=False,
                         shown=file, folder_fd=target.folder_fd, refuse_hard_links=True)
        finally:
            target.close()
    return FileFix(file, fixed, diff)


def _compiles(text: str) -> bool:
    try:
        compile(text, "<fix>", "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # a null byte; nested past the parser's stack
        return False
    return True


def unified_diff(before: str, after: str, file: str) -> str:
    """A unified diff that ``patch`` and ``git apply`` read back exactly: lines end at "\\n"
    only (not at the form feeds, lone CRs or U+2028 that str.splitlines also splits at), and
    a last line with no newline is marked ``\\ No newline at end of file``."""
    rows = difflib.unified_diff(_lines(before), _lines(after), fromfile=f"a/{file}", tofile=f"b/{file}")
    return "".join(row if row.endswith("\n") else f"{row}\n\\ No newline at end of file\n" for row in rows)


def _lines(text: str) -> list[str]:
    lines = text.split("\n")
    return [f"{line}\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
