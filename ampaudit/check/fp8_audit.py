"""``check --dtype fp8``: which Linears of a model can train in fp8 under a recipe, measured on
its example inputs (``graph/fp8_verdicts.py``), reported as AMP7xx findings at the line that
calls each layer, with the per-layer table in ``Report.fp8``."""

from __future__ import annotations

import time
from typing import Any

import torch

from ampaudit.core.dtypes import E4M3
from ampaudit.core.errors import UsageError
from ampaudit.core.findings import Finding, Report, Target
from ampaudit.core.listing import listed
from ampaudit.core.paths import display_path
from ampaudit.core.rulebook import rule
from ampaudit.graph.forward import ExampleInputs, refuse_meta
from ampaudit.graph.fp8_casts import RECIPES
from ampaudit.graph.fp8_measure import Fp8Layer
from ampaudit.graph.fp8_other_gemms import other_gemms, other_gemms_note, unrun_linears, unrun_linears_note
from ampaudit.graph.fp8_verdicts import Fp8Judgement, judge, mx_tokens_problem, zero_grad_note

DEFAULT_RECIPE = "tensorwise"  # torchao's default Float8LinearConfig


def fp8_audit(model: torch.nn.Module, inputs: ExampleInputs | None, recipe: str | None, *, file: str,
              entry: str) -> Report:
    """The fp8 audit of ``model``: one fp32 forward and backward on ``inputs``, every Linear's
    operands cast as each recipe casts them, verdicts under ``recipe``."""
    recipe = recipe or DEFAULT_RECIPE
    if recipe not in RECIPES:
        raise UsageError(f"unknown fp8 recipe {recipe!r} (expected one of {', '.join(RECIPES)})")
    if inputs is None:
        raise UsageError("an fp8 audit runs the model: it needs example inputs (example_inputs() or --input-shape)")
    refuse_meta(model, inputs, "an fp8 audit measures the model: give it real weights")
    start = time.perf_counter()
    judgement = judge(model, inputs, recipe)
    seconds = time.perf_counter() - start
    findings = [_finding(v.code, layer.layer, v.fields, file, v.case) for layer in judgement.layers
                for v in layer.verdicts]
    notes = [_cost_note(judgement, seconds)]
    sampled = [layer.layer for layer in judgement.layers if layer.layer.sampled]
    if sampled:
        notes.append(_sampled_note(sampled))
    if not judgement.layers:
        notes.append("no nn.Linear ran on the example inputs: nothing for fp8 training to convert")
    zero = [layer.layer.name for layer in judgement.layers if layer.layer.zero_grad]
    if zero:
        notes.append(zero_grad_note(zero))
    if recipe == "mxfp8" and (problem := mx_tokens_problem({v.layer.name: v.layer.rows for v in judgement.layers
                                                             if not v.keep})):
        notes.append(f"{problem}: torchao asserts it at the first step")
    other = other_gemms_note(other_gemms(model))
    if other:
        notes.append(other)
    unrun = unrun_linears_note(unrun_linears(model, {layer.layer.name for layer in judgement.layers}))
    if unrun and judgement.layers:
        notes.append(unrun)
    report = Report(Target(file, entry, "fp8", notes), E4M3, [], findings)
    report.fp8 = judgement.to_dict(seconds)
    return report


def _finding(code: str, layer: Fp8Layer, fields: dict[str, Any], file: str, case: str | None = None) -> Finding:
    """``case``: which of the rule's ``[CODE.messages]`` and ``[CODE.hints]`` (None: its own message, ``fix``)."""
    where = display_path(layer.file) if layer.file else file
    info = rule(code)
    fix = info.hints.get(case or "fix", info.hints.get("fix"))
    return info.finding(where, layer.line or 1, module=layer.name, fix=fix, layer=layer.name, case=case, **fields)


def _cost_note(judgement: Fp8Judgement, seconds: float) -> str:
    m = judgement.measurement
    base = m.seconds.get("forward_backward", 0.0)
    # the recording pass computes no weight gradients: a plain training step's backward does more
    ratio = f" ({seconds / base:.1f}x its recording forward and backward)" if base > 0 else ""
    return (f"fp8 ({judgement.recipe}): one fp32 forward and backward on the example inputs, every nn.Linear's "
            f"input, weight and output gradient cast as each recipe casts them (emulated, as torchao computes "
            f"them); {seconds:.2f} s{ratio}")


def _sampled_note(layers: list[Fp8Layer]) -> str:
    from ampaudit.graph.fp8_measure import SAMPLE

    names = listed([f"{layer.name or '(model)'} ({_dims(layer)})" for layer in layers], 3)
    return (f"{len(layers)} large nn.Linear measured on a sample of at most {SAMPLE} tokens, output and input "
            f"features each, every outlier token and channel kept (each sampled element cast exactly, the "
            f"per-tensor scales from the whole tensors): {names}")


def _dims(layer: Fp8Layer) -> str:
    total = {"tokens": layer.rows, "out_features": layer.out_features, "in_features": layer.in_features}
    return ", ".join(f"{n} of {total[dim]} {dim}" for dim, n in layer.sampled.items())
