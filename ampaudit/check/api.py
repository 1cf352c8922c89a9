"""``ampaudit.check``: the Python API - audit a model object, or a file as the command line does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ampaudit.check.audit import audit_model
from ampaudit.check.options import CheckOptions, is_fp8
from ampaudit.check.run import check_targets
from ampaudit.core.arguments import require_module
from ampaudit.core.catalog import build_catalog
from ampaudit.core.config import Config, load_config
from ampaudit.core.dtypes import LowDtype
from ampaudit.core.errors import UsageError
from ampaudit.core.finalize import finalize
from ampaudit.core.findings import Report
from ampaudit.core.paths import display_path
from ampaudit.graph.forward import ExampleInputs
from ampaudit.graph.fx_tracer import forward_location
from ampaudit.load.spec import parse_target


def check(
    model: torch.nn.Module,
    example_inputs: Any = None,
    *,
    dtype: LowDtype | torch.dtype | str = torch.float16,
    policy: str | Path | Mapping | None = None,
    config: Config | None = None,
    run: bool = True,
    fp8_recipe: str | None = None,
) -> Report:
    """Audit ``model`` for mixed precision.

    ``dtype="fp8"``: which ``nn.Linear`` layers can train in float8 under ``fp8_recipe``
    (tensorwise, rowwise, rowwise_with_gw_hp, mxfp8; default tensorwise), measured on
    ``example_inputs`` (docs/fp8.md); the per-layer table is ``Report.fp8``.

    ``example_inputs``: a tuple of positional args, a dict of kwargs or a tensor; when given,
    the model runs once (fp32, no grad) so untraceable models are still audited.
    ``policy``: a TOML file or a table with the ops.toml schema, layered over the catalog.
    ``run=False``: never execute the model (no value ranges; untraceable parts stay unseen).
    """
    require_module(model, "ampaudit.check", eager=True)
    file = forward_location(model).file
    config = config if config is not None else load_config(Path(file) if Path(file).is_file() else None)
    inputs = ExampleInputs.coerce(example_inputs, "example_inputs") if example_inputs is not None else None
    if is_fp8(dtype):
        from ampaudit.check.fp8_audit import fp8_audit

        report = fp8_audit(model, inputs, fp8_recipe, file=display_path(file), entry=type(model).__name__)
        return finalize(report, config)
    if fp8_recipe is not None:
        raise UsageError("fp8_recipe goes with dtype='fp8'")
    report = audit_model(model, inputs, build_catalog(config, policy), LowDtype.parse(dtype),
                         file=display_path(file), entry=type(model).__name__, run=run)
    return finalize(report, config)


def check_path(
    spec: str,
    *,
    config: Config | None = None,
    dtype: LowDtype | str | None = None,
    allow_exec: bool = False,
    input_shapes: Sequence[str] = (),
    input_dtypes: Sequence[str] = (),
    policy_files: Sequence[Path] = (),
    run: bool = True,
) -> Report:
    """What ``ampaudit check PATH[:NAME]`` reports: the graph audit when the file defines a
    model, and the training-script lint on its source."""
    path, _ = parse_target(spec)
    config = config if config is not None else load_config(path if path.exists() else None)
    options = CheckOptions(dtype=dtype, allow_exec=allow_exec, input_shapes=input_shapes,
                           input_dtypes=input_dtypes, policy_files=policy_files, run=run)
    return check_targets([spec], config, options)
