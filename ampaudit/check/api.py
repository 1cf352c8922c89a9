"""``ampaudit.check``: trace a model, classify every op, report what needs attention."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ampaudit.check.classify import classify
from ampaudit.check.coverage import coverage
from ampaudit.check.graph_view import GraphView
from ampaudit.check.measure import measure_ranges
from ampaudit.check.rules import run_graph_rules
from ampaudit.check.run import CheckOptions, check_targets
from ampaudit.core.catalog import Catalog, load_catalog
from ampaudit.core.config import DTYPES, Config, finalize, load_config
from ampaudit.core.errors import UsageError
from ampaudit.core.findings import Finding, NodeDecision, Report, Target
from ampaudit.core.paths import display_path
from ampaudit.core.rulebook import rule
from ampaudit.graph.fx_tracer import forward_location
from ampaudit.graph.trace import TraceResult, trace_model
from ampaudit.target.inputs import ExampleInputs
from ampaudit.target.loader import NotImported, load_target
from ampaudit.target.spec import parse_target

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, torch.dtype):
        name = _DTYPE_NAMES.get(dtype)
    else:
        name = {"fp16": "float16", "half": "float16", "bf16": "bfloat16"}.get(dtype, dtype)
    if name not in DTYPES:
        raise UsageError(f"dtype must be float16 or bfloat16 (got {dtype!r})")
    return name


def build_catalog(config: Config, policy: str | Path | Mapping | None = None,
                  policy_files: Sequence[Path] = ()) -> Catalog:
    tables: list[tuple[Mapping, str]] = []
    if config.policy:
        tables.append((config.policy, f"{config.source or 'pyproject.toml'} [tool.ampaudit.policy]"))
    files = list(policy_files)
    if isinstance(policy, Mapping):
        tables.append((policy, "policy argument"))
    elif policy is not None:
        files.append(Path(policy))
    return load_catalog(files, tables)


def audit_model(
    model: torch.nn.Module,
    inputs: ExampleInputs | None,
    catalog: Catalog,
    dtype: str,
    *,
    file: str,
    entry: str,
    run: bool = True,
) -> Report:
    """The graph audit every front end shares: trace, measure (with inputs), analyse.

    ``run=False`` never executes the model: example inputs are ignored.
    """
    measure = inputs is not None and run
    trace = trace_model(model, catalog, inputs if run else None, validate=not measure)
    if measure:
        measure_ranges(trace.graphs[0].gm, inputs, catalog, dtype)
    report = analyse(trace, catalog, dtype, file=file, entry=entry)
    if measure:
        report.target.notes.append(
            f"measured value ranges on the example inputs ({inputs.origin}): one fp32 run, each op re-run "
            f"in {dtype} on its fp32 inputs cast down")
    elif inputs is not None:
        report.target.notes.append("--no-run: the model was not executed; no value ranges were measured")
    return report


def analyse(trace: TraceResult, catalog: Catalog, dtype: str, *, file: str, entry: str) -> Report:
    """Classify every node, run the graph rules, and say what the trace could not see."""
    nodes: list[NodeDecision] = []
    findings: list[Finding] = []
    for sub in trace.graphs:
        view = GraphView.build(sub, catalog, dtype, frozenset(trace.opaque))
        nodes += classify(view)
        findings += run_graph_rules(view)
    op_count = sum(n.op.startswith("call_") for n in nodes)
    notes, coverage_findings = coverage(trace, op_count)
    return Report(Target(file, entry, trace.method, notes), dtype, nodes, findings + coverage_findings)


def check(
    model: torch.nn.Module,
    example_inputs: Any = None,
    *,
    dtype: torch.dtype | str = torch.float16,
    policy: str | Path | Mapping | None = None,
    config: Config | None = None,
    run: bool = True,
) -> Report:
    """Audit ``model`` for mixed precision.

    ``example_inputs``: a tuple of positional args, a dict of kwargs or a tensor; when given,
    the model runs once (fp32, no grad) so untraceable models are still audited.
    ``policy``: a TOML file or a table with the ops.toml schema, layered over the catalog.
    ``run=False``: never execute the model (no value ranges; untraceable parts stay unseen).
    """
    file = forward_location(model).file
    config = config if config is not None else load_config(Path(file) if Path(file).is_file() else None)
    inputs = ExampleInputs.coerce(example_inputs, "example_inputs") if example_inputs is not None else None
    report = audit_model(model, inputs, build_catalog(config, policy), dtype_name(dtype),
                         file=display_path(file), entry=type(model).__name__, run=run)
    return finalize(report, config)


def check_path(
    spec: str,
    *,
    config: Config | None = None,
    dtype: str | None = None,
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


def graph_report(spec: str, config: Config, options: CheckOptions) -> Report:
    """The graph audit of the model ``PATH[:NAME]`` defines (not finalized)."""
    dtype = dtype_name(options.dtype or config.dtype)
    catalog = build_catalog(config, policy_files=options.policy_files)  # bad policy: fail before importing
    loaded = load_target(spec, allow_exec=options.allow_exec, input_shapes=options.input_shapes,
                         input_dtypes=options.input_dtypes)
    if isinstance(loaded, NotImported):
        return _not_imported_report(loaded, dtype)
    return audit_model(loaded.model, loaded.inputs, catalog, dtype,
                       file=display_path(str(loaded.path)), entry=loaded.entry, run=options.run)


def _not_imported_report(skipped: NotImported, dtype: str) -> Report:
    file = display_path(str(skipped.path))
    finding = rule("AMP003").finding(file, skipped.line, column=skipped.column, what=skipped.what)
    note = (f"not imported: {skipped.what} at line {skipped.line} would run on import; "
            "no graph audit ran (pass --exec to import it anyway)")
    return Report(Target(file, skipped.entry, "none", [note]), dtype, [], [finding])
