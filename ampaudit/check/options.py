"""What ``ampaudit check`` was asked to do, beyond the configuration: the command line's
choices, shared by the runner (which files) and the graph audit (how)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ampaudit.core.config import Config
from ampaudit.core.dtypes import E4M3, LowDtype
from ampaudit.core.errors import UsageError
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


def is_fp8(dtype: object) -> bool:
    """``--dtype fp8`` (or float8): not a LowDtype - an fp8 audit judges a recipe."""
    return isinstance(dtype, str) and dtype.lower() in ("fp8", "float8")


def audit_dtype(options: CheckOptions, config: Config) -> LowDtype:
    """The dtype a graph audit reports against, the fp8 flags checked: the same whether the
    model is imported or its file refused from the source (AMP003), torch-free."""
    fp8 = is_fp8(options.dtype)
    if options.fp8_recipe is not None and not fp8:
        raise UsageError("--fp8-recipe goes with --dtype fp8")
    if fp8 and not options.run:
        raise UsageError("an fp8 audit measures the model on its example inputs: --no-run leaves nothing to measure")
    return E4M3 if fp8 else LowDtype.parse(options.dtype or config.dtype)
