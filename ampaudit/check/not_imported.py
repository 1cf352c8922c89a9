"""The report of a model file that was not imported (AMP003): its top level would run code.
Torch-free: ``ampaudit check FILE.py`` decides this from the source before any import of
torch, so a training script costs the lint and nothing more."""

from __future__ import annotations

from ampaudit.core.dtypes import LowDtype
from ampaudit.core.findings import Report, Target
from ampaudit.core.paths import display_path
from ampaudit.core.rulebook import rule
from ampaudit.load.source_scan import NotImported


def not_imported_report(skipped: NotImported, dtype: LowDtype) -> Report:
    """AMP003 at the first code that would run on import, and a note saying no graph audit ran."""
    file = display_path(str(skipped.path))
    finding = rule("AMP003").finding(file, skipped.line, column=skipped.column, what=skipped.what)
    note = (f"not imported: {skipped.what} at line {skipped.line} would run on import; "
            "no graph audit ran (pass --exec to import it anyway)")
    return Report(Target(file, skipped.entry, "none", [note]), dtype, [], [finding])
