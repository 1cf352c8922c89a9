"""Which Linears train in fp8 under a recipe, and why the others stay in bf16: the AMP7xx
verdicts over an fp8 measurement (``graph/fp8_measure.py``), thresholds from rules.toml.
check reports them as findings; convert turns them into torchao's ``module_filter_fn``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ampaudit.core.listing import listed
from ampaudit.core.rulebook import rule
from ampaudit.graph.forward import ExampleInputs
from ampaudit.graph.fp8_casts import BLOCK, MX_BLOCK, RECIPES, ROW
from ampaudit.graph.fp8_measure import Fp8Layer, Fp8Measurement, OperandStats, dominance, measure_fp8

# the verdicts this module gives
FP8_CODES = ("AMP701", "AMP702", "AMP703", "AMP704", "AMP705", "AMP706", "AMP707", "AMP708")


@dataclass
class Verdict:
    code: str
    fields: dict[str, Any]
    reason: str  # a short why, for the table and the emitted filter's comment
    case: str | None = None  # which of the rule's messages and hints ([CODE.messages], [CODE.hints]); None: its own


@dataclass
class LayerVerdict:
    layer: Fp8Layer
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def keep(self) -> bool:
        return bool(self.verdicts)

    @property
    def reason(self) -> str:
        return "; ".join(v.reason for v in self.verdicts) if self.verdicts else "fp8"


def _finite(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "inf" if value > 0 else "-inf"


def _db(value: float) -> str:
    return "inf" if value == math.inf else f"{value:.1f}"


def _ratio(value: float) -> str:
    return "inf" if value == math.inf else f"{value:.3g}"


def _ordinary_grad_weight(ops: dict[str, OperandStats]) -> float:
    """The ordinary tokens' weight-gradient SQNR under a recipe's grad-weight input cast (inf
    where it was not measured: no gradient)."""
    value = ops["input"].sqnr_grad_weight_rest_db
    return math.inf if value is None else value


def layer_verdicts(layer: Fp8Layer, recipe: str) -> list[Verdict]:
    """The AMP701-AMP704 and AMP706-AMP708 verdicts on one layer (AMP705 needs the whole model: ``judge``)."""
    found = []
    own = layer.own_forward
    if own is not None:
        what = ("an nn.Linear whose forward is wrapped on the instance" if own["instance"] else
                f"a {own['class']}, an nn.Linear subclass with a forward of its own")
        if own["extra"]:  # loralib's lora.Linear: its output equals F.linear's until lora_B trains
            extra = ", ".join(own["extra"])
            found.append(Verdict("AMP706", {"what": what, "extra": extra},
                                 f"{own['class']} holds {extra}: torchao's Float8Linear would replace it", "extra"))
        elif own["difference"] > rule("AMP706").params["max_relative_difference"]:
            difference = ("its shape" if own["difference"] == math.inf
                          else f"{own['difference'] * 100:.3g}% of its norm")
            found.append(Verdict("AMP706", {"what": what, "difference": difference},
                                 f"{own['class']}.forward computes more than F.linear: torchao's Float8Linear "
                                 "would replace it"))
    if layer.computed_weight is not None:
        found.append(Verdict("AMP706", {"how": layer.computed_weight},
                             f"its weight is computed by {layer.computed_weight}: torchao's Float8Linear "
                             "takes a Parameter", "computed"))
    multiple = RECIPES[recipe].dim_multiple
    dims = " and ".join(f"{n} {v}" for n, v in (("in_features", layer.in_features),
                                                 ("out_features", layer.out_features)) if v % multiple)
    if dims:
        found.append(Verdict("AMP701", {"in_features": layer.in_features, "out_features": layer.out_features,
                                        "dims": dims, "multiple": multiple}, f"{dims} not divisible by {multiple}",
                             case="mx" if RECIPES[recipe].input.granularity == BLOCK else None))
    if recipe == "mxfp8" and layer.tied_to:  # quantize_ gives the weight a Parameter of its own
        tied = ", ".join(f"`{n}`" for n in layer.tied_to)
        found.append(Verdict("AMP707", {"tied": tied}, f"its weight is tied to {tied}: MXFP8 training unties it"))
    if layer.permuted_input is not None and RECIPES[recipe].input.granularity == ROW:
        found.append(Verdict("AMP708", {"layout": layer.permuted_input, "recipe": recipe},
                             f"its input is a permuted view: torchao's {recipe} cannot reshape it"))
    ops = layer.operands[recipe]
    rest = ops["input"].sqnr_rest_db
    tokens_input = bool(layer.outlier_tokens) and rest < rule("AMP702").params["min_sqnr_db"]
    # per-row scales are the advice: where torchao's cannot take the input (AMP708), say what they need
    permuted = ("; its input is a permuted view, which torchao's rowwise recipes cannot take (AMP708): make it "
                "contiguous before the layer" if layer.permuted_input is not None else "")
    tokens = {"tokens": layer.outlier_tokens, "rows": layer.rows, "ratio": _ratio(layer.token_ratio), "recipe": recipe,
              "permuted": permuted}
    if tokens_input:
        rowwise = layer.operands["rowwise"]["input"].sqnr_rest_db
        found.append(Verdict("AMP702", {**tokens, "sqnr": _db(rest), "rowwise": _db(rowwise)},
                             f"massive-activation tokens: the others keep {_db(rest)} dB in {recipe} "
                             f"(rowwise {_db(rowwise)} dB)"))
    elif layer.outlier_tokens and (gw := _ordinary_grad_weight(ops)) < rule("AMP702").params["min_grad_weight_sqnr_db"]:
        # the forward's scales keep the ordinary tokens; the grad-weight GEMM's, along the tokens
        # (per channel in rowwise), are set by the outlier tokens again
        found.append(Verdict("AMP702", {**tokens, "sqnr": _db(gw), "input": _db(rest)},
                             f"massive-activation tokens: the others' weight gradient keeps {_db(gw)} dB in "
                             f"{recipe}'s grad-weight GEMM (rowwise_with_gw_hp keeps it exact)", case="grad_weight"))
    if not tokens_input and rest < rule("AMP703").params["min_sqnr_db"]:
        mx = layer.operands["mxfp8"]["input"].sqnr_rest_db
        or_mx = " or use mxfp8" if mx >= rule("AMP703").params["min_sqnr_db"] else ""
        found.append(Verdict("AMP703", {"channels": layer.outlier_channels, "ratio": _ratio(layer.channel_ratio),
                                        "recipe": recipe, "sqnr": _db(rest), "mxfp8": _db(mx), "or_mx": or_mx},
                             f"outlier channels: the other elements keep {_db(rest)} dB in {recipe} "
                             f"(mxfp8 {_db(mx)} dB)"))
    grad = ops.get("grad_output")
    fmt = RECIPES[recipe].grad_output_for_grad_weight.fmt  # None: the grad-weight GEMM runs in high precision
    starved = grad.starved_features if grad is not None else None
    if fmt is not None and starved is not None and starved >= rule("AMP704").params["min_features"]:
        e5m2 = layer.operands["tensorwise"]["grad_output"].starved_features or 0.0
        features = round(starved * layer.out_features)
        found.append(Verdict("AMP704", {"share": f"{starved * 100:.3g}%", "features": features,
                                        "out_features": layer.out_features, "fmt": fmt.short,
                                        "recipe": recipe, "percent": f"{grad.flushed * 100:.3g}%",
                                        "e5m2": "" if recipe == "tensorwise" else
                                        f"; tensorwise's e5m2 would starve {e5m2 * 100:.3g}%"},
                             f"{features} of {layer.out_features} output features lose their weight "
                             f"gradient to flushing in {fmt.short}"))
    return found


@dataclass
class Fp8Judgement:
    measurement: Fp8Measurement
    layers: list[LayerVerdict]

    @property
    def recipe(self) -> str:
        return self.measurement.recipe

    @property
    def keep(self) -> list[LayerVerdict]:
        return [v for v in self.layers if v.keep]

    def to_dict(self, seconds: float | None = None) -> dict[str, Any]:
        """Plain data: check's ``Report.fp8`` (JSON, the table), convert's plan. ``seconds``:
        the whole audit's time, beside its parts'."""
        m = self.measurement
        layers = []
        for v in self.layers:
            row = v.layer.to_dict()
            row.update(verdict="bf16" if v.keep else "fp8", reason=v.reason, rules=[x.code for x in v.verdicts])
            layers.append(row)
        times = dict(m.seconds)
        if seconds is not None:
            times["total"] = seconds
        return {"recipe": m.recipe, "layers": layers, "output_sqnr_db": _finite(m.output_sqnr_db),
                "output_sqnr_without_db": _finite(m.output_sqnr_without_db), "dominant": m.dominant,
                "seconds": {k: round(t, 4) for k, t in times.items()}}


def judge(model: nn.Module, inputs: ExampleInputs, recipe: str) -> Fp8Judgement:
    """Measure ``model`` on ``inputs`` (eval mode: no dropout) and judge every Linear under ``recipe``."""
    if recipe not in RECIPES:
        from ampaudit.core.errors import UsageError

        raise UsageError(f"unknown fp8 recipe {recipe!r} (expected one of {', '.join(RECIPES)})")
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        measurement = measure_fp8(model, inputs, recipe)
        layers = [LayerVerdict(layer, layer_verdicts(layer, recipe)) for layer in measurement.layers]
        candidates = [v.layer.name for v in layers if not v.keep]
        dominance(model, inputs, measurement, candidates, rule("AMP705").params["min_layers"])
    finally:
        for m, training in modes.items():
            m.train(training)
    m = measurement
    params = rule("AMP705").params
    if (m.dominant is not None and m.output_sqnr_db is not None and m.output_sqnr_without_db is not None
            and len(candidates) >= params["min_layers"]
            and m.output_sqnr_db < params["max_output_sqnr_db"]
            and m.output_sqnr_without_db - m.output_sqnr_db >= params["min_gain_db"]):
        verdict = next(v for v in layers if v.layer.name == m.dominant)
        fields = {"all": _db(m.output_sqnr_db), "without": _db(m.output_sqnr_without_db),
                  "own": _db(verdict.layer.gemms.get("output", math.inf))}
        verdict.verdicts.append(Verdict("AMP705", fields,
                                        f"dominates the output's fp8 error ({_db(m.output_sqnr_db)} -> "
                                        f"{_db(m.output_sqnr_without_db)} dB kept in bf16)"))
    return Fp8Judgement(measurement, layers)


def mx_tokens_problem(rows: dict[str, int]) -> str | None:
    """Why torchao's MXFP8 training cannot take these batches, or None: it casts the
    grad-weight GEMM's operands in blocks of 32 along the tokens and asserts every fp8 Linear's
    tokens per batch (``rows``: layer -> tokens) are a multiple of 32."""
    odd = next(((name, n) for name, n in rows.items() if n % MX_BLOCK), None)
    if odd is None:
        return None
    return (f"mxfp8 training needs each batch's tokens to be a multiple of {MX_BLOCK} (its grad-weight GEMM casts "
            f"along them); the example inputs give `{odd[0]}` {odd[1]}")


def zero_grad_note(names: list[str]) -> str:
    """Layers whose output gradient was exactly zero on the example inputs: a layer after them
    starts at zero (DiT's adaLN-Zero), so their backward GEMMs had nothing to measure."""
    shown = listed([n or "(model)" for n in names], 4)
    return (f"{len(names)} nn.Linear got an all-zero output gradient on the example inputs ({shown}): a layer "
            "downstream starts at zero (a zero-initialised last layer or gate, as DiT's adaLN-Zero), so their "
            "grad_output, grad-input and grad-weight were not measured - only their forward is judged; audit a "
            "checkpoint that has trained a few steps to judge the backward")
