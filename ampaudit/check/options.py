"""What ``ampaudit check`` was asked to do, beyond the configuration: the command line's
choices, shared by the runner (which files) and the graph audit (how)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ampaudit.core.dtypes import LowDtype
from ampaudit.load.time_limit import DEFAULT_SECONDS


@dataclass
class CheckOptions:
    """Options of one ``ampaudit check`` run (the CLI flags); the config holds the rest."""

    dtype: LowDtype | str | None = None  # None: the config's; "fp8": the fp8 audit (check/fp8_audit.py)
    fp8_recipe: str | None = None  # with dtype "fp8": the recipe judged (None: tensorwise)
    allow_exec: bool = False
    import_timeout: float | None = DEFAULT_SECONDS  # for the model file's import and model build; None: no limit
    input_shapes: Sequence[str] = ()
    input_dtypes: Sequence[str] = ()
    model_config: Sequence[str] = ()  # --config KEY=VALUE for an hf:MODEL_TYPE target
    policy_files: Sequence[Path] = ()
    run: bool = True
    lint_only: bool = False
    exclude: Sequence[str] = ()
    jobs: int | None = None  # worker processes for many files; None: all cores
    progress: Callable[[int], Callable[[], None]] | None = None  # given a total, returns "one more done"
    notes: list[str] = field(default_factory=list)
    isolate: bool = False  # run the model's code in a child process (the command line; core/child.py)
