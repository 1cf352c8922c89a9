"""AMP415 for the custom autograd Functions a model applies, wherever they are defined.

The lint asks it of a file that uses autocast; a model file rarely holds its Functions
(improved-diffusion's UNet imports its recomputing ``CheckpointFunction`` from ``nn.py``, a file
that never mentions autocast), and a model audit is the question "what happens under autocast".
So each Function class one of the audit's runs applied is linted where it is defined, by the
same rule, and reported at its class line.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path

from ampaudit.check.lint.collect import collect
from ampaudit.check.lint_file import read_text
from ampaudit.check.script_rules.autograd_function import function_finding
from ampaudit.core.errors import LoadError
from ampaudit.core.findings import Finding
from ampaudit.core.userframe import Loc


def applied_function_findings(functions: Mapping[type, Loc | None]) -> list[Finding]:
    """One AMP415 per Function class (of ``functions``, as ``functions_applied`` collects them)
    that lacks custom_fwd/custom_bwd where it matters, at its definition."""
    found = []
    facts_by_file = {}
    for function in functions:
        try:
            path, (_, line) = inspect.getsourcefile(function), inspect.getsourcelines(function)
        except (OSError, TypeError, SyntaxError):  # an exec'd string, a C extension, a file changed since
            continue
        if path is None or not Path(path).is_file():
            continue
        if path not in facts_by_file:
            try:
                facts_by_file[path] = collect(path, read_text(Path(path)))
            except (LoadError, SyntaxError, ValueError, RecursionError):  # read_text: LoadError, not OSError
                facts_by_file[path] = None
        facts = facts_by_file[path]
        cls = next((c for c in facts.classes if c.node.name == function.__name__ and c.node.lineno == line),
                   None) if facts is not None else None
        result = function_finding(facts, cls) if cls is not None else None
        if result is not None:
            found.append(result)
    return found
