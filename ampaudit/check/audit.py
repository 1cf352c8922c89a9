"""The graph audit of one model: trace it, measure its ranges on example inputs, classify
every op and run the graph rules. Shared by the ``check()`` API and ``ampaudit check``."""

from __future__ import annotations

import torch

from ampaudit.check.classify import classify
from ampaudit.check.coverage import coverage
from ampaudit.check.function_audit import applied_function_findings
from ampaudit.check.graph_rules import run_graph_rules
from ampaudit.check.not_imported import not_imported_report
from ampaudit.check.options import CheckOptions, audit_dtype, is_fp8
from ampaudit.core.catalog import Catalog, build_catalog
from ampaudit.core.config import Config
from ampaudit.core.dtypes import LowDtype
from ampaudit.core.findings import Finding, NodeDecision, Report, Target
from ampaudit.graph.declared import Declared, declared_precision
from ampaudit.graph.forward import ExampleInputs, failures_explained, refuse_meta
from ampaudit.graph.function_apply import functions_applied
from ampaudit.graph.measure import measure_ranges
from ampaudit.graph.trace import TraceResult, trace_model
from ampaudit.graph.view import GraphView
from ampaudit.load.loader import NotImported, load_target


def audit_model(
    model: torch.nn.Module,
    inputs: ExampleInputs | None,
    catalog: Catalog,
    dtype: LowDtype,
    *,
    file: str,
    entry: str,
    run: bool = True,
) -> Report:
    """The graph audit every front end shares: trace, measure (with inputs), analyse.

    ``run=False`` never executes the model: example inputs are ignored.
    """
    measure = inputs is not None and run
    if measure:
        refuse_meta(model, inputs, "pass --no-run (run=False) to audit the graph without running it")
    with functions_applied() as functions, failures_explained(model, inputs if run else None):
        # functions: the custom autograd Functions the model runs, for AMP415
        trace = trace_model(model, catalog, inputs if run else None, validate=not measure)
        if measure:
            measure_ranges(trace.graphs[0].gm, inputs, catalog, dtype)
    report = analyse(trace, catalog, dtype, file=file, entry=entry, declared=declared_precision(model, dtype))
    report.findings += applied_function_findings(functions)
    if measure:
        report.target.notes.append(
            f"measured value ranges on the example inputs ({inputs.origin}): one fp32 run, each op re-run "
            f"in {dtype} on its fp32 inputs cast down")
    elif inputs is not None:
        report.target.notes.append("--no-run: the model was not executed; no value ranges were measured")
    return report


def analyse(trace: TraceResult, catalog: Catalog, dtype: LowDtype, *, file: str, entry: str,
            declared: Declared | None = None) -> Report:
    """Classify every node, run the graph rules, and say what the trace could not see.

    ``declared``: what the model declares about its own precision (fp32 modules, the dtype
    it was trained in)."""
    nodes: list[NodeDecision] = []
    findings: list[Finding] = []
    for index, sub in enumerate(trace.graphs):
        view = GraphView.build(sub, catalog, dtype, frozenset(trace.opaque), declared=declared,
                               model_wide=index == 0)
        nodes += classify(view)
        findings += run_graph_rules(view)
    op_count = sum(n.op.startswith("call_") for n in nodes)
    notes, coverage_findings = coverage(trace, op_count)
    return Report(Target(file, entry, trace.method, notes), dtype, nodes, findings + coverage_findings)


def graph_report(spec: str, config: Config, options: CheckOptions) -> Report:
    """The graph audit of the model a target spec names (``PATH[:NAME_OR_EXPR]``,
    ``module:NAME_OR_EXPR``, ``hf:MODEL_TYPE``; not finalized)."""
    fp8 = is_fp8(options.dtype)
    dtype = audit_dtype(options, config)
    catalog = build_catalog(config, policy_files=options.policy_files)  # bad policy: fail before importing
    loaded = load_target(spec, allow_exec=options.allow_exec, input_shapes=options.input_shapes,
                         input_dtypes=options.input_dtypes, model_config=options.model_config,
                         import_timeout=options.import_timeout)
    if isinstance(loaded, NotImported):
        return not_imported_report(loaded, dtype)
    if fp8:
        from ampaudit.check.fp8_audit import fp8_audit

        report = fp8_audit(loaded.model, loaded.inputs, options.fp8_recipe, file=loaded.label, entry=loaded.entry)
        report.target.notes += loaded.notes
        return report
    report = audit_model(loaded.model, loaded.inputs, catalog, dtype, file=loaded.label, entry=loaded.entry,
                         run=options.run)
    report.target.notes += loaded.notes
    return report


