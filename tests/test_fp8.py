"""fp8 (issue 29): the recipes' casts emulated exactly as torchao computes them, and
`check --dtype fp8` on models with planted outliers - SQNR per token class, verdicts per recipe."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
from torch import nn

from ampaudit.core.dtypes import E4M3, E5M2
from ampaudit.graph.fp8_casts import BLOCK, RECIPES, ROW, TENSOR, Cast, CastResult, cast, linear_gemms
from ampaudit.graph.fp8_measure import sqnr_db
from tests.conftest import model as model_path

TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _torchao():
    pytest.importorskip("torchao.float8")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return Float8LinearConfig, convert_to_float8_training


@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
def test_emulated_gemms_equal_torchaos_emulated_float8_linear_bit_for_bit(recipe):
    config_cls, convert = _torchao()
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(64, 32)
    x = torch.randn(3, 5, 64, generator=g)
    x[:, 0] *= 300.0  # a row far larger than the rest: row and tensor scales differ
    grad = torch.randn(3, 5, 32, generator=g) * 1e-3
    fp8 = nn.Sequential(copy.deepcopy(linear))
    convert(fp8, config=dataclasses.replace(config_cls.from_recipe_name(recipe), emulate=True))
    xr = x.clone().requires_grad_()
    out = fp8(xr)
    out.backward(grad)
    mine = linear_gemms(x.reshape(-1, 64), linear.weight.detach(), grad.reshape(-1, 32), RECIPES[recipe])
    assert torch.equal(mine.output + linear.bias.detach(), out.detach().reshape(-1, 32))
    assert torch.equal(mine.grad_input, xr.grad.reshape(-1, 64))
    assert torch.equal(mine.grad_weight, fp8[0].weight.grad)


@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
def test_the_grad_weight_gemms_input_cast_is_torchaos_per_channel_across_the_tokens(recipe):
    # AMP702's grad-weight measure casts the input as torchao's cast_config_input_for_grad_weight
    # does: rowwise per channel (axiswise, dim 0: one scale per column, across every token), e4m3,
    # power-of-two scales; rowwise_with_gw_hp not at all; tensorwise one scale per tensor
    config_cls, _ = _torchao()
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    config = config_cls.from_recipe_name(recipe)
    theirs, mine = config.cast_config_input_for_grad_weight, RECIPES[recipe].input_for_grad_weight
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    x[0] = 1e5  # a massive token: it sets every channel's scale
    if theirs.scaling_type is ScalingType.DISABLED:
        assert mine.fmt is None and cast(x, mine, 0, pow2=True).value is x
        return
    axiswise = theirs.scaling_granularity is ScalingGranularity.AXISWISE
    assert (mine.fmt.torch, mine.granularity, RECIPES[recipe].pow2_scales) == \
        (theirs.target_dtype, ROW if axiswise else TENSOR, config.round_scales_to_power_of_2)
    t = hp_tensor_to_float8_dynamic(x, theirs.target_dtype, LinearMMConfig(),
                                    scaling_granularity=theirs.scaling_granularity,
                                    axiswise_dim=0 if axiswise else None,
                                    round_scales_to_power_of_2=config.round_scales_to_power_of_2)
    assert t._scale.shape == ((1, 16) if axiswise else ())
    assert torch.equal(cast(x, mine, 0, pow2=RECIPES[recipe].pow2_scales).value, t._data.float() / t._scale)


def test_mx_cast_equals_torchaos_to_mx():
    pytest.importorskip("torchao.prototype.mx_formats")
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 6, 96)
    scale, data = to_mx(x, torch.float8_e4m3fn, 32)
    theirs = (data.float().reshape(6, 3, 32) * scale.float().reshape(6, 3, 1)).reshape(6, 96)
    assert torch.equal(cast(x, Cast(E4M3, BLOCK), -1, pow2=True).value, theirs)


def test_tensorwise_scale_maps_amax_to_the_format_max():
    x = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    for fmt in (E4M3, E5M2):
        q = cast(x, Cast(fmt, TENSOR), -1, pow2=False)
        assert torch.equal(q.value, x)  # 2 -> fmax; 1, 0.5 are powers of two: exact in both formats
        assert (q.flushed, q.saturated, q.nonzero) == (0, 0, 3)


def test_row_scales_are_powers_of_two_and_flushes_are_counted():
    x = torch.tensor([[1000.0, 1e-3, 3.0], [1.0, 0.75, 0.0]])
    q = cast(x, Cast(E4M3, ROW), -1, pow2=True)
    # row 0: scale 2^floor(log2(448/1000)) = 0.25; 1e-3 * 0.25 is below e4m3's smallest subnormal / 2
    assert q.flushed == 1 and q.value[0, 1] == 0
    assert q.value[0, 0] == 1024.0  # 250 rounds to 256 in e4m3 (3 mantissa bits)
    assert torch.equal(q.value[1], x[1])
    tensorwise = cast(x, Cast(E4M3, TENSOR), -1, pow2=False)
    assert tensorwise.flushed == 1  # 1e-3 * 0.448 also flushes; 0.75 * 0.448 does not


def test_mx_saturates_what_its_floor_scale_pushes_past_448():
    x = torch.full((1, 32), 1.0)
    x[0, 0] = 511.0  # scale 2^(8-8) = 1: 511 > 448 clamps
    q = cast(x, Cast(E4M3, BLOCK), -1, pow2=True)
    assert q.saturated == 1 and q.value[0, 0] == 448.0


def _check(cli, name, *args):
    result = cli("check", model_path(name), "--dtype", "fp8", "--format", "json", *args)
    assert result.code in (0, 1), result.err
    return json.loads(result.out)


def _codes(report):
    return sorted({(f["rule"], f["module"]) for f in report["findings"]})


def _layer(report, name):
    return next(layer for layer in report["fp8"]["layers"] if layer["name"] == name)


def test_massive_tokens_get_the_tensorwise_verdict_and_the_rowwise_grad_weight_one_not_gw_hps(cli):
    tensorwise = _check(cli, "fp8_massive_tokens.py")
    assert _codes(tensorwise) == [("AMP702", "fc1")]
    fc1 = _layer(tensorwise, "fc1")
    assert fc1["outlier_tokens"] == 4 and fc1["verdict"] == "bf16"
    ops = fc1["operands"]
    # the whole tensor hides it: the 4 huge tokens hold its energy; the other 60 lost most bits
    assert ops["tensorwise"]["input"]["sqnr_db"] > 30 and ops["tensorwise"]["input"]["sqnr_rest_db"] < 20
    assert ops["rowwise"]["input"]["sqnr_rest_db"] > 30
    # the ordinary tokens' output rows too: 18 dB, where the whole output keeps 28.8
    assert fc1["gemms"]["output"] > 28 and fc1["gemms"]["output_ordinary_tokens"] < 20
    assert _layer(tensorwise, "fc2")["verdict"] == "fp8"
    # the forward's per-row scales recover the ordinary tokens, the grad-weight GEMM's per-channel
    # scales across the tokens do not (the massive ones set them): 22.7 dB of their part of dW
    assert [ops[r]["input"]["sqnr_grad_weight_rest_db"] for r in ("rowwise", "rowwise_with_gw_hp")] == \
        [pytest.approx(22.74, abs=0.01), "inf"]
    assert "sqnr_grad_weight_rest_db" not in _layer(tensorwise, "fc2")["operands"]["rowwise"]["input"]  # no outliers
    rowwise = _check(cli, "fp8_massive_tokens.py", "--fp8-recipe", "rowwise")
    assert _codes(rowwise) == [("AMP702", "fc1")] and _layer(rowwise, "fc1")["gemms"]["output_ordinary_tokens"] > 28
    (finding,) = rowwise["findings"]
    assert finding["line"] == 17 and finding["message"] == (
        "4 of 64 tokens entering `fc1` are massive activations (amax 3.82e+04x the median token's): rowwise's "
        "forward scales keep the other tokens (31.6 dB SQNR), but its grad-weight GEMM (dW = grad_output^T @ input, "
        "a reduction over the tokens) scales the input along the tokens, where the massive tokens set the scales "
        "again: the other tokens' contribution to the weight gradient keeps 22.7 dB SQNR: use rowwise_with_gw_hp "
        "(that GEMM in high precision) or keep it in bf16")
    assert finding["fix"] == ("train it with rowwise_with_gw_hp (its grad-weight GEMM in high precision), "
                              "or keep it in bf16")
    assert _layer(rowwise, "fc1")["reason"] == ("massive-activation tokens: the others' weight gradient keeps 22.7 dB "
                                                "in rowwise's grad-weight GEMM (rowwise_with_gw_hp keeps it exact)")
    # its grad-weight GEMM in high precision: nothing to flag
    gw_hp = _check(cli, "fp8_massive_tokens.py", "--fp8-recipe", "rowwise_with_gw_hp")
    assert _codes(gw_hp) == [] and [x["verdict"] for x in gw_hp["fp8"]["layers"]] == ["fp8", "fp8"]


def test_a_block_without_outliers_gets_no_verdict_under_any_recipe_and_no_grad_weight_measure(cli):
    from tests.conftest import RULE_FIXTURES

    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"):
        result = cli("check", RULE_FIXTURES / "AMP702_valid.py", "--dtype", "fp8", "--fp8-recipe", recipe,
                     "--format", "json")
        assert result.code == 0, result.err
        report = json.loads(result.out)
        assert report["findings"] == [] and [x["verdict"] for x in report["fp8"]["layers"]] == ["fp8", "fp8"]
        # no outlier token: the ordinary tokens' part of dW is not measured apart (it is the whole)
        assert all("sqnr_grad_weight_rest_db" not in ops["input"] for x in report["fp8"]["layers"]
                   for ops in x["operands"].values())


def test_the_grad_weight_verdict_follows_its_threshold_and_the_ordinary_tokens_part_of_dw_exactly(monkeypatch):
    from ampaudit.core.rulebook import rule
    from ampaudit.graph.fp8_measure import Fp8Layer, OperandStats
    from ampaudit.graph.fp8_verdicts import layer_verdicts

    # the ordinary tokens' part of dW, G_o^T X_o, with X cast per channel across every token
    g = torch.Generator().manual_seed(3)
    x, grad = torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)
    x[0] = 1e5  # every channel's scale 2^-8: the other tokens' entries are 2^-8 N(0, 1), 2 subnormal steps per sd
    report = _weighted_check(x, grad, "rowwise")
    fc = report.fp8["layers"][0]
    q = cast(x, Cast(E4M3, ROW), 0, pow2=True).value
    expected = sqnr_db(grad[1:].t() @ x[1:], grad[1:].t() @ q[1:])
    assert fc["operands"]["rowwise"]["input"]["sqnr_grad_weight_rest_db"] == pytest.approx(expected, abs=1e-3)
    assert fc["outlier_tokens"] == 1 and 15 < expected < 20 and fc["rules"] == ["AMP702"]
    # where it is measured only the threshold decides
    stats = lambda gw: {"input": OperandStats(40.0, 31.0, 0.0, 0.0, sqnr_grad_weight_rest_db=gw)}  # noqa: E731
    layer = Fp8Layer("fc", 16, 16, 32, None, 1, {}, 1, 0)
    limit = rule("AMP702").params["min_grad_weight_sqnr_db"]
    for gw, codes in ((limit - 0.01, ["AMP702"]), (limit, []), (math.inf, []), (None, [])):
        layer.operands = {"rowwise": stats(gw)}
        assert [(v.code, v.case) for v in layer_verdicts(layer, "rowwise")] == [(c, "grad_weight") for c in codes]
    layer.outlier_tokens = 0  # no massive token: the rule is not about this layer
    layer.operands = {"rowwise": stats(limit - 10)}
    assert layer_verdicts(layer, "rowwise") == []
    monkeypatch.setitem(rule("AMP702").params, "min_grad_weight_sqnr_db", expected - 0.01)
    assert _weighted_check(x, grad, "rowwise").findings == []


def test_outlier_channels_get_tensorwise_and_rowwise_verdicts_not_mxfp8(cli):
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        assert _codes(_check(cli, "fp8_outlier_channels.py", "--fp8-recipe", recipe)) == [("AMP703", "proj")]
    report = _check(cli, "fp8_outlier_channels.py", "--fp8-recipe", "mxfp8")
    assert _codes(report) == [("AMP701", "out")]  # Linear(32, 16): MXFP8 takes dims in blocks of 32
    proj = _layer(report, "proj")
    assert proj["outlier_channels"] == 1 and proj["outlier_tokens"] == 0
    ops = proj["operands"]
    assert ops["mxfp8"]["input"]["sqnr_rest_db"] > 20 > ops["rowwise"]["input"]["sqnr_rest_db"]


class _WeightedGrad(nn.Module):
    """A Linear whose output gradient is ``weights`` (tokens x features): the loss is (y * weights).sum()."""

    def __init__(self, weights: torch.Tensor) -> None:
        super().__init__()
        self.fc = nn.Linear(weights.shape[1], weights.shape[1])
        self.register_buffer("weights", weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self.weights).sum()


def _grad_underflow(weights: torch.Tensor, recipe: str = "tensorwise") -> tuple[dict, list[str]]:
    import ampaudit

    torch.manual_seed(0)
    report = ampaudit.check(_WeightedGrad(weights), (torch.randn(*weights.shape),), dtype="fp8", fp8_recipe=recipe)
    fc = report.fp8["layers"][0]
    return fc["operands"][recipe]["grad_output"], fc["rules"]


def _weighted_check(x: torch.Tensor, weights: torch.Tensor, recipe: str):
    """``check --dtype fp8`` of one Linear whose input is ``x`` and output gradient ``weights``."""
    import ampaudit

    torch.manual_seed(0)
    return ampaudit.check(_WeightedGrad(weights), (x,), dtype="fp8", fp8_recipe=recipe)


def test_grad_underflow_fires_where_output_features_lose_their_gradient_not_on_flushed_noise():
    # one output weighed 1e6, 31 at 1e-5 (AMP704_invalid): the 31 columns flush whole in e5m2,
    # a negligible share of the tensor's energy but the only gradient their weight rows get
    starving = torch.cat([torch.tensor([1e6]), torch.full((31,), 1e-5)]).expand(16, 32).clone()
    grad, rules = _grad_underflow(starving)
    assert grad["flushed"] == 31 / 32 and grad.get("starved_features") == 31 / 32 and rules == ["AMP704"]
    # rowwise's grad-weight GEMM scales each feature's column by its own amax: nothing starves
    # (its grad-input cast, per token, still flushes the 31)
    grad, rules = _grad_underflow(starving, "rowwise")
    assert grad["flushed"] == 31 / 32 and grad.get("starved_features") == 0 and rules == []
    # the first token's gradient is noise 2^40 below the others' (a causal first query's): 1/16 of
    # the elements flush, in every column, yet every column keeps all but 1e-24 of its energy
    noise = torch.ones(16, 32)
    noise[0] = 1e-12
    grad, rules = _grad_underflow(noise)
    assert grad["flushed"] == 1 / 16 and grad.get("starved_features") == 0 and rules == []
    # a feature starves where flushing takes at least half its energy: in e5m2 at the scale of
    # amax 1, 1e-10 flushes and 2e-10 does not; column 0 loses 14 / (14 + 2 x 4) of its energy,
    # column 1 4 / (4 + 12 x 4)
    mixed = torch.ones(16, 32)
    mixed[:, 0], mixed[:, 1] = 2e-10, 2e-10
    mixed[:14, 0] = 1e-10
    mixed[:4, 1] = 1e-10
    grad, rules = _grad_underflow(mixed)
    assert grad["flushed"] == 18 / 512 and grad.get("starved_features") == 1 / 32 and rules == ["AMP704"]


def test_odd_dims_stay_in_bf16_under_every_recipe(cli):
    for recipe in RECIPES:
        report = _check(cli, "fp8_odd_dims.py", "--fp8-recipe", recipe)
        assert [(layer["name"], layer["divisible_by_16"]) for layer in report["fp8"]["layers"]] == [
            ("body", True), ("head", False)]
        messages = [(f["rule"], f["module"], f["message"]) for f in report["findings"]]
        if recipe != "mxfp8":
            assert messages == [("AMP701", "head", "`head` is Linear(64, 10): out_features 10 not divisible by 16, "
                                 "which fp8 GEMMs (torch._scaled_mm) cannot take: keep it in bf16")]
            continue
        # MXFP8's blocks of 32 along each GEMM's reduction dim: 48 does not take them either
        assert messages == [
            ("AMP701", "body", "`body` is Linear(48, 64): in_features 48 not divisible by 32, "
             "MXFP8's block, which its casts along every GEMM's reduction dim need: keep it in bf16"),
            ("AMP701", "head", "`head` is Linear(64, 10): out_features 10 not divisible by 32, "
             "MXFP8's block, which its casts along every GEMM's reduction dim need: keep it in bf16")]


def test_fp8_json_report_matches_the_schema_and_text_has_the_table(cli):
    from importlib import resources

    schema = json.loads(resources.files("ampaudit.report").joinpath("report.schema.json").read_text())
    report = _check(cli, "fp8_massive_tokens.py")
    jsonschema.validate(report, schema)
    ops = report["fp8"]["layers"][0]["operands"]["tensorwise"]
    assert "starved_features" in ops["grad_output"] and "starved_features" not in ops["input"]
    bad = copy.deepcopy(report)
    bad["fp8"]["layers"][0]["operands"]["tensorwise"]["grad_output"]["starved_features"] = 1.5
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    assert report["dtype"] == "float8_e4m3fn" and report["fp8"]["recipe"] == "tensorwise"
    text = cli("check", model_path("fp8_massive_tokens.py"), "--dtype", "fp8")
    assert text.code == 1
    assert "fp8 by layer" in text.out and "bf16: massive-activation tokens" in text.out


def test_bad_fp8_arguments_are_one_line(cli):
    result = cli("check", model_path("fp8_odd_dims.py"), "--fp8-recipe", "rowwise")
    assert result.code == 2 and "--fp8-recipe goes with --dtype fp8" in result.err
    result = cli("check", model_path("fp8_odd_dims.py"), "--dtype", "fp8", "--no-run")
    assert result.code == 2 and "--no-run leaves nothing to measure" in result.err
    result = cli("check", model_path("untraceable_no_inputs.py"), "--dtype", "fp8")
    assert result.code == 2 and "it needs example inputs" in result.err
    with pytest.raises(SystemExit) as exited:  # argparse's choices
        cli("check", model_path("fp8_odd_dims.py"), "--dtype", "fp8", "--fp8-recipe", "blockwise")
    assert exited.value.code == 2


def test_sqnr_matches_its_definition():
    x = torch.tensor([3.0, 4.0])
    assert sqnr_db(x, x) == math.inf
    assert sqnr_db(x, x + torch.tensor([0.5, 0.0])) == pytest.approx(10 * math.log10(25 / 0.25))


def test_fp8_policy_names_exactly_the_layers_kept_and_why():
    import ampaudit
    from tests.conftest import MODELS

    spec = importlib.util.spec_from_file_location("fp8_massive_tokens", MODELS / "fp8_massive_tokens.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.MassiveTokens()
    policy = ampaudit.fp8_policy(model, module.example_inputs(), recipe="tensorwise")
    assert policy.recipe == "tensorwise" and policy.fp8 == ["fc2"]
    assert list(policy.keep) == ["fc1"] and policy.keep["fc1"].startswith("AMP702: massive-activation tokens")
    assert not policy.module_filter_fn(model.fc1, "fc1") and policy.module_filter_fn(model.fc2, "fc2")
    assert not policy.module_filter_fn(nn.Embedding(4, 4), "emb")  # quantize_ asks of every module
    # no recipe: the torchao recipe that keeps the fewest layers (rowwise recovers the tokens in the
    # forward, but only rowwise_with_gw_hp in the grad-weight GEMM too)
    chosen = ampaudit.fp8_policy(model, module.example_inputs())
    assert (chosen.recipe, chosen.keep, chosen.fp8) == ("rowwise_with_gw_hp", {}, ["fc1", "fc2"])
    rowwise = ampaudit.fp8_policy(model, module.example_inputs(), recipe="rowwise")
    assert rowwise.keep == {"fc1": "AMP702: massive-activation tokens: the others' weight gradient keeps 22.7 dB in "
                                   "rowwise's grad-weight GEMM (rowwise_with_gw_hp keeps it exact)"}
    mx = ampaudit.fp8_policy(model, module.example_inputs(), recipe="mxfp8")
    assert (mx.recipe, mx.keep, mx.fp8) == ("mxfp8", {}, ["fc1", "fc2"])
    with pytest.raises(ampaudit.core.errors.UsageError, match="the fp8 recipes are tensorwise, rowwise, "):
        ampaudit.fp8_policy(model, module.example_inputs(), recipe="delayed")


def test_fp8_policy_on_an_eval_model_whose_forward_fills_a_cache_dict():
    # timm's LeViT caches its gathered attention biases in a dict in eval mode: the first of the
    # policy's two measurements (one per recipe, to choose) left its graph's tensor there, and the
    # second's backward raised "Trying to backward through the graph a second time"
    import ampaudit
    from fixtures.models import cached_attention_bias

    torch.manual_seed(0)
    model = cached_attention_bias.get_model().eval()
    cache = model.attn.attention_bias_cache
    policy = ampaudit.fp8_policy(model, cached_attention_bias.example_inputs())
    assert policy.fp8 == ["attn.qkv", "attn.proj"] and list(policy.keep) == ["head"]
    assert model.attn.attention_bias_cache is cache and cache == {}  # as it was found
    copy.deepcopy(model)  # no tensor of ampaudit's graphs left behind


def test_convert_emits_a_torchao_file_that_runs_as_written_and_repeats_the_verification(cli, tmp_path):
    _torchao()
    out = tmp_path / "out"
    result = cli("convert", model_path("fp8_massive_tokens.py"), "--dtype", "fp8", "--emit", "torchao",
                 "--fp8-recipe", "tensorwise", "--train-steps", "8", "-o", out)
    assert result.code == 0, result.err
    assert "fc1: AMP702: massive-activation tokens" in result.out
    plan = json.loads((out / "fp8_plan.json").read_text())
    assert plan["recipe"] == "tensorwise" and list(plan["keep"]) == ["fc1"] and plan["fp8"] == ["fc2"]
    text = (out / "fp8_torchao.py").read_text()
    assert "KEEP_IN_BF16 = {\n    'fc1',  # AMP702: massive-activation tokens" in text
    _runs_as_written(out, plan, tmp_path)


def test_the_emitted_file_trains_a_model_whose_eval_forward_fills_a_cache(cli, tmp_path):
    # timm's LeViT caches its attention biases in eval mode, the mode the file's verify() trains
    # in: the fp8 copy's second backward met the first step's freed graph (convert exited 1),
    # and the bf16 copy kept the target's no-grad biases, which never trained
    _torchao()
    import importlib

    from fixtures.models import cached_attention_bias

    out = tmp_path / "out"
    result = cli("convert", model_path("cached_attention_bias.py"), "--dtype", "fp8", "--emit", "torchao",
                 "--fp8-recipe", "tensorwise", "--train-steps", "3", "-o", out)
    assert result.code == 0, result.err
    _runs_as_written(out, json.loads((out / "fp8_plan.json").read_text()), tmp_path)
    spec = importlib.util.spec_from_file_location("emitted_fp8", out / "fp8_torchao.py")
    emitted = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emitted)
    torch.manual_seed(0)
    net, x = cached_attention_bias.get_model().eval(), cached_attention_bias.example_inputs()
    train = emitted.verify(net, x, steps=3)
    by_hand = copy.deepcopy(net).train()  # train mode: no cache, the biases train
    with torch.no_grad():
        target = torch.randn(by_hand(*x).shape, generator=torch.Generator().manual_seed(0)) * float(by_hand(*x).std())
    adamw, losses = torch.optim.AdamW(by_hand.parameters(), lr=1e-3), []
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(by_hand(*x).float(), target)
        adamw.zero_grad()
        loss.backward()
        adamw.step()
        losses.append(float(loss))
    assert train["bf16"] == losses and train["passed"]
    assert net.attn.attention_bias_cache == {}

def _mx_training():
    _torchao()
    pytest.importorskip("torchao.prototype.moe_training.config")


def _runs_as_written(out, plan, cwd):
    run = subprocess.run([sys.executable, str(out / "fp8_torchao.py")], capture_output=True, text=True,
                         cwd=cwd, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    train = plan["train"]
    assert run.stdout.strip().endswith(
        f"{train['steps']} steps, loss {train['bf16'][-1]:.6g} (bf16) vs {train['fp8'][-1]:.6g} (fp8): "
        f"gap {train['worst']:.4g} (tolerance 0.05)")


def test_convert_emits_mxfp8_with_torchaos_mx_training_and_its_file_repeats_the_verification(tmp_path):
    _mx_training()
    out = tmp_path / "out"
    # a process of its own: torchao's import-time log lines ("Failed to load .../_C_mxfp8...so" without
    # its CUDA kernels) are not about the user's model and stay out of stderr
    result = subprocess.run([sys.executable, "-m", "ampaudit", "convert", model_path("fp8_outlier_channel_lm.py"),
                             "--dtype", "fp8", "--emit", "torchao", "--fp8-recipe", "mxfp8", "--train-steps", "6",
                             "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]
    plan = json.loads((out / "fp8_plan.json").read_text())
    # the outlier channel: MXFP8's blocks keep it (no AMP703); the 16-class head is no multiple of 32
    assert plan["recipe"] == "mxfp8" and plan["fp8"] == ["proj", "fc2"]
    assert plan["keep"] == {"head": "AMP701: out_features 16 not divisible by 32"}
    text = (out / "fp8_torchao.py").read_text()
    assert "MXFP8TrainingOpConfig(kernel_preference=kernels, scale_calculation_mode=ScaleCalculationMode.FLOOR)" in text
    train = plan["train"]
    assert train["passed"] and train["fp8"] != train["bf16"]  # trained in MXFP8: not bf16's curve
    _runs_as_written(out, plan, tmp_path)


def test_a_tied_head_is_kept_in_bf16_under_mxfp8_whose_training_unties_it():
    # quantize_(MXFP8TrainingOpConfig) gives the head's weight a Parameter of its own over the
    # embedding's storage: AdamW updated it twice a step (0.02 at lr 0.01); float8 keeps the tie
    import ampaudit

    _mx_training()
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization import quantize_

    spec = importlib.util.spec_from_file_location("amp707", Path(__file__).parent.parent / "fixtures" / "rules" /
                                                  "AMP707_invalid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model, inputs = module.TiedLM(), module.example_inputs()
    mx = ampaudit.fp8_policy(model, inputs, recipe="mxfp8")
    assert mx.keep == {"lm_head": "AMP707: its weight is tied to `wte.weight`: MXFP8 training unties it"}
    assert mx.fp8 == ["mlp"] and mx.table["layers"][1]["tied_to"] == ["wte.weight"]
    assert ampaudit.fp8_policy(model, inputs, recipe="tensorwise").keep == {}
    untied = copy.deepcopy(model)
    quantize_(untied, MXFP8TrainingOpConfig(), filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
    assert untied.lm_head.weight is not untied.wte.weight
    kept = copy.deepcopy(model)
    quantize_(kept, MXFP8TrainingOpConfig(), filter_fn=mx.module_filter_fn)
    assert kept.lm_head.weight is kept.wte.weight


def test_the_emitted_mxfp8_file_keeps_each_linears_bias_which_torchaos_mx_training_drops(tmp_path):
    # torchao 0.18's MXFP8TrainingWeightWrapperTensor computes F.linear(x, w, b) as x @ w.T: a
    # Linear(32, 64) after a LayerNorm came out 18% off, and its bias got no gradient
    _mx_training()
    from ampaudit.convert.fp8 import Fp8Policy, emit_torchao, load_emitted

    path = tmp_path / "fp8_torchao.py"
    path.write_text(emit_torchao(Fp8Policy("mxfp8", {}, ["0"])))
    emitted = load_emitted(path)
    torch.manual_seed(0)
    linear = nn.Linear(64, 64)
    model = emitted.convert(nn.Sequential(copy.deepcopy(linear)), emulate=True)
    assert type(model[0].weight).__name__ == "MXFP8TrainingWeightWrapperTensor"
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    out = model(x)
    gemm = linear_gemms(x, linear.weight.detach(), torch.ones(32, 64), RECIPES["mxfp8"]).output
    assert torch.equal(out.detach(), gemm + linear.bias.detach())
    out.sum().backward()
    assert torch.equal(model[0].bias.grad, torch.full((64,), 32.0))
    assert emitted._drops_bias()  # what this torchao does; the file adds the bias back only then


def test_mxfp8_training_needs_tokens_in_blocks_of_32_said_in_one_line(cli, tmp_path):
    _mx_training()
    result = cli("convert", model_path("fp8_outlier_channels.py"), "--dtype", "fp8", "--emit", "torchao",
                 "--fp8-recipe", "mxfp8", "-o", tmp_path / "out")
    assert result.code == 2 and result.err.count("\n") == 1, result.err
    assert "mxfp8 training needs each batch's tokens to be a multiple of 32" in result.err
    assert "the example inputs give `proj` 16" in result.err and not (tmp_path / "out").exists()
    notes = _check(cli, "fp8_outlier_channels.py", "--fp8-recipe", "mxfp8")["target"]["notes"]
    assert [n for n in notes if "multiple of 32" in n] == [
        "mxfp8 training needs each batch's tokens to be a multiple of 32 (its grad-weight GEMM casts along them); "
        "the example inputs give `proj` 16: torchao asserts it at the first step"]
    assert not [n for n in _check(cli, "fp8_outlier_channels.py")["target"]["notes"] if "multiple of 32" in n]


@pytest.mark.parametrize("recipe", ["rowwise_with_gw_hp", "mxfp8"])
def test_emulated_training_under_cpu_autocast_takes_bf16_inputs_from_autocast_ops(cli, tmp_path, recipe):
    # fc2's input is gelu's output under CPU autocast (bf16); torchao's emulated high-precision
    # grad-weight GEMM (and its emulated MX GEMM) met a bf16 and an fp32 operand: convert failed
    # with "unexpected RuntimeError: expected m1 and m2 to have the same dtype"
    _mx_training()
    out = tmp_path / "out"
    result = cli("convert", model_path("fp8_sink_token_lm.py"), "--dtype", "fp8", "--emit", "torchao",
                 "--fp8-recipe", recipe, "--train-steps", "4", "-o", out)
    assert result.code == 0, result.err
    plan = json.loads((out / "fp8_plan.json").read_text())
    assert "fc2" in plan["fp8"] and plan["train"]["passed"]
    _runs_as_written(out, plan, tmp_path)


def test_emulated_training_under_cpu_autocast_casts_an_input_passed_by_keyword_too(cli, tmp_path):
    # head(input=gelu(...)): the emitted file's input cast read args[0] only, so under CPU autocast
    # the emulated high-precision grad-weight GEMM met bf16 and fp32 again ("expected m1 and m2 to
    # have the same dtype"): convert exited 1 under rowwise_with_gw_hp
    _torchao()
    model = tmp_path / "m.py"
    model.write_text(
        "import torch\nfrom torch import nn\n\n\nclass Net(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.fc, self.head = nn.Linear(32, 64), nn.Linear(64, 32)\n\n"
        "    def forward(self, x):\n        return self.head(input=nn.functional.gelu(self.fc(input=x)))\n\n\n"
        "def example_inputs():\n    return (torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0)),)\n")
    out = tmp_path / "out"
    result = cli("convert", f"{model}:Net", "--dtype", "fp8", "--emit", "torchao", "--fp8-recipe",
                 "rowwise_with_gw_hp", "--train-steps", "2", "-o", out)
    assert result.code == 0, result.err
    plan = json.loads((out / "fp8_plan.json").read_text())
    assert plan["fp8"] == ["fc", "head"] and plan["train"]["passed"]


def test_a_policy_written_untrained_is_verified_with_the_default_steps_when_run(cli, tmp_path):
    _torchao()
    out = tmp_path / "out"
    result = cli("convert", model_path("fp8_massive_tokens.py"), "--dtype", "fp8", "--emit", "torchao",
                 "--train-steps", "0", "-o", out)
    assert result.code == 0, result.err
    text = (out / "fp8_torchao.py").read_text()
    assert "STEPS = 20\n" in text and "Run this file to verify it (ampaudit wrote it untrained" in text
    run = subprocess.run([sys.executable, str(out / "fp8_torchao.py")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert run.returncode == 0 and "; 20 steps, loss " in run.stdout, run.stderr[-2000:]  # was an IndexError


def test_convert_fp8_fails_past_the_tolerance(cli, tmp_path):
    _torchao()
    result = cli("convert", model_path("fp8_odd_dims.py"), "--dtype", "fp8", "--emit", "torchao", "--train-steps",
                 "4", "--tolerance", "0", "-o", tmp_path / "out")
    assert result.code == 1 and "OUTSIDE 0%" in result.out
    assert "head: AMP701: out_features 10 not divisible by 16" in result.out


def test_convert_fp8_flags_are_checked(cli, tmp_path):
    result = cli("convert", model_path("fp8_odd_dims.py"), "--emit", "torchao", "-o", tmp_path / "a")
    assert result.code == 2 and "--emit torchao writes an fp8 policy: pass --dtype fp8" in result.err
    result = cli("convert", model_path("fp8_odd_dims.py"), "--dtype", "fp8", "--emit", "hf", "-o", tmp_path / "b")
    assert result.code == 2 and "emits torchao's policy only" in result.err


def test_an_fp8_export_is_an_export_again_into_its_folder_with_force_and_with_the_umasks_modes(cli, tmp_path):
    """The fp8 export had no manifest and kept mkdtemp's 0700: a second export into its folder
    was refused as the user's files, --force into a folder of the user's failed with exit 2
    after moving files in, and a hard link to the model there was not refused."""
    import stat

    model = model_path("fp8_odd_dims.py")
    out = tmp_path / "out"
    assert cli("convert", model, "--dtype", "fp8", "--no-verify", "-o", out).code == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~_umask()
    assert json.loads((out / "ampaudit-export.json").read_text())["files"] == ["fp8_torchao.py", "fp8_plan.json",
                                                                              "fp8_inputs.pt"]
    assert cli("convert", model, "--dtype", "fp8", "--no-verify", "-o", out).code == 0
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    result = cli("convert", model, "--dtype", "fp8", "--no-verify", "--force", "-o", mine)
    assert result.code == 0, result.err
    assert sorted(os.listdir(mine)) == ["ampaudit-export.json", "fp8_inputs.pt", "fp8_plan.json", "fp8_torchao.py",
                                        "notes.txt"]
    linked = tmp_path / "linked"
    linked.mkdir()
    os.link(model, linked / "fp8_torchao.py")
    result = cli("convert", model, "--dtype", "fp8", "--no-verify", "--force", "-o", linked)
    assert result.code == 2 and "would overwrite" in result.err and "fp8_odd_dims.py" in result.err
    # the model itself named fp8_torchao.py, converted into its own folder: it was overwritten
    named = tmp_path / "named"
    named.mkdir()
    text = Path(model).read_text()
    (named / "fp8_torchao.py").write_text(text)
    result = cli("convert", named / "fp8_torchao.py", "--dtype", "fp8", "--no-verify", "--force", "-o", named)
    assert result.code == 2 and "would overwrite" in result.err
    assert (named / "fp8_torchao.py").read_text() == text and os.listdir(named) == ["fp8_torchao.py"]


def test_an_fp8_export_over_ulimit_f_names_the_output_not_the_staging_folder(cli, tmp_path):
    """It said "cannot write /tmp/.out.ampaudit-PID-XXXXXXXX/fp8_torchao.py": a name that never exists."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (3000, hard))  # the emitted file is about 5 kB
    try:
        result = cli("convert", model_path("fp8_odd_dims.py"), "--dtype", "fp8", "--no-verify", "-o", tmp_path / "out")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert result.code == 2
    assert result.err == f"ampaudit: error: cannot write {tmp_path / 'out' / 'fp8_torchao.py'}: File too large\n"
    assert list(tmp_path.iterdir()) == []


def test_an_empty_batch_is_one_line_not_an_index_error(cli, tmp_path):
    """A batch of 0 reached torch's amax over no elements: 'unexpected IndexError'."""
    import ampaudit
    from ampaudit.core.errors import LoadError

    with pytest.raises(LoadError, match=r"^the example inputs give nn.Linear '\(model\)' no rows \(a batch of 0\?\)"):
        ampaudit.fp8_policy(nn.Linear(16, 16), (torch.randn(0, 16),))
    model = tmp_path / "m.py"
    model.write_text("from torch import nn\n\n\ndef get_model():\n    return nn.Sequential(nn.Linear(16, 16))\n")
    result = cli("check", model, "--dtype", "fp8", "--input-shape", "0,16")
    assert result.code == 2
    assert result.err == ("ampaudit: error: the example inputs give nn.Linear '0' no rows (a batch of 0?): nothing "
                          "to measure in fp8\n")


def test_a_model_without_linear_layers_has_no_fp8_policy(cli, tmp_path):
    """It wrote a policy of 0 layers, an emitted file that converts nothing, and exited 0."""
    import ampaudit
    from ampaudit.core.errors import LoadError

    with pytest.raises(LoadError, match=r"^no nn.Linear ran on the example inputs: nothing for fp8 training"):
        ampaudit.fp8_policy(nn.Sequential(nn.Conv1d(4, 4, 3), nn.ReLU()), (torch.randn(2, 4, 8),))
    model = tmp_path / "m.py"
    model.write_text("from torch import nn\n\n\ndef get_model():\n    return nn.Sequential(nn.Conv1d(4, 4, 3))\n")
    _torchao()  # convert --dtype fp8 needs torchao before it measures
    out = tmp_path / "out"
    result = cli("convert", model, "--dtype", "fp8", "--emit", "torchao", "--input-shape", "2,4,8", "-o", out)
    assert result.code == 2
    assert result.err.startswith("ampaudit: error: no nn.Linear ran on the example inputs")
    assert result.err.count("\n") == 1 and not out.exists()


def test_a_file_not_imported_is_amp003_under_dtype_fp8_too(cli, tmp_path):
    """AMP003 decided from the source (before torch) parsed --dtype as a LowDtype: 'dtype must be
    float16 or bfloat16 (got 'fp8')', exit 2, and --fp8-recipe without fp8 passed unchecked there."""
    script = tmp_path / "train.py"
    script.write_text("from torch import nn\n\n\ndef get_model():\n    return nn.Linear(2, 2)\n\n\n"
                      "open('log.txt', 'w')\n")
    result = cli("check", script, "--dtype", "fp8", "--format", "json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["dtype"] == "float8_e4m3fn" and [f["rule"] for f in report["findings"]] == ["AMP003"]
    result = cli("check", script, "--fp8-recipe", "rowwise")
    assert result.code == 2 and result.err == "ampaudit: error: --fp8-recipe goes with --dtype fp8\n"
    assert not (tmp_path / "log.txt").exists()


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_products_are_each_layers_own_when_layers_share_inputs_and_weights():
    """q, k and v read the same input, and a head tied to an embedding shares its weight: the
    gradient autograd leaves on either is a sum over users, not the layer's own product."""
    from ampaudit.graph.forward import ExampleInputs
    from ampaudit.graph.fp8_measure import measure_fp8

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 32)
            self.q, self.k = nn.Linear(32, 32), nn.Linear(32, 32)
            self.head = nn.Linear(32, 32, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            x = self.emb(ids)
            return self.head(self.q(x) * self.k(x) + x)

    torch.manual_seed(0)
    ids = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(0))
    m = measure_fp8(Shared(), ExampleInputs.coerce((ids,), "ids"), "tensorwise")
    for layer in m.layers:
        assert 15 < layer.gemms["grad_input"] < 40 and 15 < layer.gemms["grad_weight"] < 40, (layer.name, layer.gemms)


def test_the_check_api_audits_fp8_too():
    import ampaudit
    from tests.conftest import MODELS

    spec = importlib.util.spec_from_file_location("fp8_odd_dims", MODELS / "fp8_odd_dims.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = ampaudit.check(module.OddHead(), module.example_inputs(), dtype="fp8", fp8_recipe="rowwise")
    assert [(f.rule, f.module) for f in report.findings] == [("AMP701", "head")]
    assert report.fp8["recipe"] == "rowwise" and [layer["verdict"] for layer in report.fp8["layers"]] == ["fp8", "bf16"]


def test_a_linear_called_with_its_input_by_keyword_is_measured_as_called_positionally():
    # fc(input=x) is nn.Linear's own parameter name: the recording's forward took no keyword
    # ("unexpected keyword argument"), and the dominance forward ran such a call in fp32
    import ampaudit

    class ByKeyword(nn.Module):
        def __init__(self, keyword):
            super().__init__()
            self.keyword = keyword
            self.fc, self.mid, self.head = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16)

        def forward(self, x):
            call = (lambda m, t: m(input=t)) if self.keyword else (lambda m, t: m(t))
            return call(self.head, torch.relu(call(self.mid, torch.relu(call(self.fc, x)))))

    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    reports = []
    for keyword in (False, True):
        torch.manual_seed(0)
        reports.append(ampaudit.check(ByKeyword(keyword), (x,), dtype="fp8").fp8)
    for report in reports:
        report.pop("seconds")
    assert reports[1] == reports[0]
    assert [layer["name"] for layer in reports[1]["layers"]] == ["fc", "mid", "head"]
    assert 20 < reports[1]["output_sqnr_db"] < 40  # every layer in fp8, not run in fp32


class _Offset(nn.Linear):
    """Computes more than F.linear: torchao's Float8Linear.from_float keeps only its weight and bias."""

    def forward(self, x):
        return super().forward(x) * 4.0 + 1.0


class _WithOffset(nn.Module):
    def __init__(self, first):
        super().__init__()
        self.fc, self.mid, self.head = first(32, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.head(torch.relu(self.mid(torch.relu(self.fc(x)))))


def test_a_linear_subclass_with_a_forward_of_its_own_is_kept_and_its_gemms_measured_against_f_linear():
    # its GEMMs were measured against its own output (x 4 + 1): 2.1 dB out, 2.5 dB grad-weight, and
    # only AMP705 kept it, as the layer that "dominates the fp8 error" - what torchao would drop
    import ampaudit

    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = _WithOffset(_Offset)
    report = ampaudit.check(model, (x,), dtype="fp8")
    assert [(f.rule, f.module) for f in report.findings] == [("AMP706", "fc")]
    assert "`fc` is a _Offset, an nn.Linear subclass with a forward of its own: its output differs" in \
        report.findings[0].message
    fc = report.fp8["layers"][0]
    assert fc["rules"] == ["AMP706"] and fc["own_forward"]["class"] == "_Offset"
    assert fc["own_forward"]["difference"] > 0.5 and all(20 < fc["gemms"][k] < 40 for k in ("output", "grad_weight"))
    policy = ampaudit.fp8_policy(model, (x,), recipe="tensorwise")
    assert list(policy.keep) == ["fc"] and policy.fp8 == ["mid", "head"]
    # torchao's swap loses the offset: what the verdict says
    config_cls, convert = _torchao()
    swapped = copy.deepcopy(model)
    convert(swapped, config=dataclasses.replace(config_cls.from_recipe_name("tensorwise"), emulate=True))
    assert type(swapped.fc).__name__ == "Float8Linear" and not torch.allclose(swapped(x), model(x), rtol=0.5)


class _LoRA(nn.Linear):
    """Shaped like loralib's lora.Linear: lora_B starts at zero, so the output is F.linear's."""

    def __init__(self, i, o, r=4):
        super().__init__(i, o)
        self.lora_A = nn.Parameter(torch.randn(r, i) * 0.1)
        self.lora_B = nn.Parameter(torch.zeros(o, r))

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias) + x @ self.lora_A.t() @ self.lora_B.t()


def test_a_linear_subclass_holding_parameters_of_its_own_is_kept_though_its_output_is_f_linears():
    # torchao's swap keeps only weight and bias: the LoRA parameters leave the model (2368 -> 2112
    # parameters on a 32-wide pair); measured by its output alone - zero lora_B - it passed as fp8
    import ampaudit

    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    report = ampaudit.check(_WithOffset(_LoRA), (x,), dtype="fp8")
    assert [(f.rule, f.module) for f in report.findings] == [("AMP706", "fc")]
    assert ("`fc` is a _LoRA, an nn.Linear subclass with a forward of its own, and holds lora_A, lora_B beside its "
            "weight and bias" in report.findings[0].message)
    assert report.fp8["layers"][0]["own_forward"]["difference"] == 0.0


def test_a_linear_subclass_that_computes_f_linear_is_not_kept():
    import ampaudit

    class Casted(nn.Linear):  # modded-nanogpt's CastedLinear: the weight cast to the input's dtype
        def forward(self, x):
            return nn.functional.linear(x, self.weight.type_as(x), self.bias.type_as(x))

    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    report = ampaudit.check(_WithOffset(Casted), (x,), dtype="fp8")
    fc = report.fp8["layers"][0]
    assert report.findings == [] and fc["verdict"] == "fp8" and fc["own_forward"]["difference"] < 1e-6


def test_convert_fp8_without_torchao_is_one_line(cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` fails, as where it is not installed
    result = cli("convert", model_path("fp8_odd_dims.py"), "--dtype", "fp8", "--emit", "torchao", "-o", tmp_path / "a")
    assert result.code == 2 and 'pip install -U "ampaudit[fp8]"' in result.err and "(torchao.float8," in result.err
    assert not (tmp_path / "a").exists()


def test_mxfp8_with_a_torchao_too_old_for_its_training_is_one_line(cli, tmp_path, monkeypatch):
    _torchao()
    monkeypatch.setitem(sys.modules, "torchao.prototype.moe_training.config", None)  # before torchao 0.18
    result = cli("convert", model_path("fp8_massive_tokens.py"), "--dtype", "fp8", "--fp8-recipe", "mxfp8",
                 "--emit", "torchao", "-o", tmp_path / "a")
    assert result.code == 2 and result.err.count("\n") == 1, result.err
    assert "(torchao.prototype.moe_training.config, which does not import here)" in result.err
    assert not (tmp_path / "a").exists()


def test_a_model_that_fails_or_has_nothing_to_train_is_one_line(tmp_path, cli):
    frozen = tmp_path / "frozen.py"
    frozen.write_text("import torch\nfrom torch import nn\n\n\nclass Frozen(nn.Module):\n"
                      "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(16, 16)\n"
                      "        self.fc.requires_grad_(False)\n\n    def forward(self, x):\n"
                      "        return self.fc(x)\n\n\n"
                      "def example_inputs():\n    return (torch.randn(4, 16),)\n")
    result = cli("check", frozen, "--dtype", "fp8")
    assert result.code == 2 and "no tensor that depends on its weights" in result.err
    broken = tmp_path / "broken.py"
    broken.write_text(frozen.read_text().replace("        self.fc.requires_grad_(False)\n", "").replace(
        "return self.fc(x)", "return self.fc(x).sum() * torch.ones(3, 3)[torch.tensor(5)].sum()"))
    result = cli("check", broken, "--dtype", "fp8")
    assert result.code == 2 and "IndexError" in result.err and "Traceback" not in result.err


class _WideMassive(nn.Module):
    """Past fp8_measure.LARGE: 1024 tokens into a 256->256 Linear, every 64th token x30000."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(256, 256)
        self.fc2 = nn.Linear(256, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _wide_inputs():
    x = torch.randn(4, 256, 256, generator=torch.Generator().manual_seed(0))
    x[:, ::64] *= 30000.0
    return (x,)


def test_a_sample_keeps_every_outlier_and_weights_the_rest():
    from ampaudit.graph.fp8_measure import sample_index

    amax = torch.ones(1000)
    amax[[3, 500, 999]] = 1e4
    amax[10] = 5.0  # the largest ordinary one is no outlier: kept only if the even spacing lands on it
    index, weight = sample_index(amax, 64)
    assert len(index) == 64 and torch.equal(index, index.sort().values) and len(set(index.tolist())) == 64
    assert {3, 500, 999} <= set(index.tolist())
    assert weight[index == 500].item() == 1.0  # every outlier measured: each stands for itself
    assert weight.sum().item() == pytest.approx(1000)  # the ordinary 61 stand for the other 997
    index, weight = sample_index(torch.ones(10), 64)  # no outlier: the largest (argmax) is one stratum
    assert index.tolist() == list(range(10)) and torch.all(weight == 1)


def test_a_sampled_layer_keeps_the_massive_token_verdict_and_says_it_was_sampled(monkeypatch):
    import ampaudit
    from ampaudit.graph import fp8_measure
    from ampaudit.report.fp8_table import fp8_table

    torch.manual_seed(0)
    model = _WideMassive()
    report = ampaudit.check(model, _wide_inputs(), dtype="fp8", fp8_recipe="tensorwise")
    fc1 = next(layer for layer in report.fp8["layers"] if layer["name"] == "fc1")
    assert fc1["sampled"] == {"tokens": 64, "out_features": 64, "in_features": 64}
    assert fc1["outlier_tokens"] == 16 and fc1["rules"] == ["AMP702"]
    assert ("AMP702", "fc1") in [(f.rule, f.module) for f in report.findings]  # fc2 gets the tokens too
    note = next(n for n in report.target.notes if "measured on a sample" in n)
    assert "fc1 (64 of 1024 tokens, 64 of 256 out_features, 64 of 256 in_features)" in note
    assert "fc1 (sampled)" in str(fp8_table(report.fp8).columns[0]._cells)
    # per-row scales recover them in the forward; the grad-weight GEMM's per-channel ones do not
    rowwise = ampaudit.check(model, _wide_inputs(), dtype="fp8", fp8_recipe="rowwise")
    assert [(f.rule, f.module) for f in rowwise.findings] == [("AMP702", "fc1")]
    assert "contribution to the weight gradient keeps 21.8 dB SQNR" in rowwise.findings[0].message
    assert ampaudit.check(model, _wide_inputs(), dtype="fp8", fp8_recipe="rowwise_with_gw_hp").findings == []
    # the sample's estimates against the whole layer measured
    monkeypatch.setattr(fp8_measure, "LARGE", 1 << 30)
    whole = ampaudit.check(model, _wide_inputs(), dtype="fp8", fp8_recipe="tensorwise")
    full = next(layer for layer in whole.fp8["layers"] if layer["name"] == "fc1")
    assert "sampled" not in full and full["rules"] == ["AMP702"]
    for recipe, ops in full["operands"].items():
        for op, stats in ops.items():
            for key in ("sqnr_db", "sqnr_rest_db", "sqnr_grad_weight_rest_db"):
                if key in stats or key in fc1["operands"][recipe][op]:
                    assert fc1["operands"][recipe][op][key] == pytest.approx(stats[key], abs=0.5), (recipe, op, key)
            assert fc1["operands"][recipe][op]["flushed"] == pytest.approx(stats["flushed"], abs=0.01)
            assert fc1["operands"][recipe][op].get("starved_features") == stats.get("starved_features")
    for key, value in full["gemms"].items():
        assert fc1["gemms"][key] == pytest.approx(value, abs=0.5), key


def test_a_sampled_layer_measures_starved_features_on_its_sampled_features_with_every_token(monkeypatch):
    from ampaudit.graph import fp8_measure

    # 1024 tokens into a 256 -> 256 Linear (sampled: 64 tokens, 64 features); the first 64 features'
    # gradient is 1e-12 of the others' and flushes whole in e5m2; the first token's is noise
    weights = torch.ones(1024, 256)
    weights[:, :64] = 1e-12
    weights[0] = 1e-12
    grad, rules = _grad_underflow(weights)
    assert grad["starved_features"] == pytest.approx(0.25, abs=0.02) and rules == ["AMP704"]
    monkeypatch.setattr(fp8_measure, "LARGE", 1 << 30)
    whole, rules = _grad_underflow(weights)
    assert whole["starved_features"] == 0.25 and rules == ["AMP704"]
    weights[:, :64] = 1.0  # only the noise token flushes: 1/1024 of the elements, no feature starves
    for large in (1 << 30, 1 << 18):
        monkeypatch.setattr(fp8_measure, "LARGE", large)
        grad, rules = _grad_underflow(weights)
        assert grad["starved_features"] == 0 and rules == []


class _MixedGemms(nn.Module):
    """A conv stem, attention with its raw in-projection, then Linears: only the Linears are fp8's."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv1d(16, 32, 1)
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        h = self.stem(x).transpose(1, 2)
        h, _ = self.attn(h, h, h)
        return self.fc(h)


def test_gemms_fp8_training_does_not_convert_are_named_in_a_note():
    # GPT-2's projections are transformers Conv1D: a table of one lm_head said nothing of them
    import ampaudit

    report = ampaudit.check(_MixedGemms(), (torch.randn(2, 16, 8),), dtype="fp8")
    assert [layer["name"] for layer in report.fp8["layers"]] == ["fc"]  # MHA reads out_proj.weight itself
    assert ("not audited: 1 nn.MultiheadAttention (in- and out-projection), 1 convolution - not nn.Linear, "
            "so torchao's convert_to_float8_training leaves them in high precision (they train as they do today)"
            in report.target.notes)
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_head=2, n_layer=2, n_positions=16, vocab_size=64)
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(config)
    report = ampaudit.check(gpt2, (torch.randint(0, 64, (2, 8)),), dtype="fp8")
    assert [layer["name"] for layer in report.fp8["layers"]] == ["lm_head"]
    assert any(note.startswith("not audited: 8 transformers Conv1D layers - ") for note in report.target.notes)
    # MHA's out_proj is the MHA note's; no Linear went unrun
    assert not any("never called as a module" in note for note in report.target.notes)


def test_a_linear_whose_weight_the_forward_reads_itself_is_named_in_a_note():
    # BEiT's and EVA's qkv: F.linear(input=x, weight=self.qkv.weight, bias=qkv_bias) - the largest
    # GEMM of the block, missing from the table without a word
    import ampaudit
    from fixtures.models import keyword_linear

    torch.manual_seed(0)
    report = ampaudit.check(keyword_linear.get_model(), keyword_linear.example_inputs(), dtype="fp8")
    assert [layer["name"] for layer in report.fp8["layers"]] == ["block.attn.proj", "head"]
    note = ("not audited: 1 nn.Linear never called as a module on the example inputs (block.attn.qkv) - a forward "
            "that reads its weight itself (F.linear(x, self.qkv.weight), as BEiT's attention does) runs that GEMM "
            "in high precision even once torchao converts the layer")
    assert note in report.target.notes


@pytest.mark.parametrize("first_call", ["reentrant_checkpoint", "no_grad"])
def test_a_linear_whose_first_call_computes_no_gradient_is_measured_on_the_one_that_does(first_call):
    # under reentrant activation checkpointing (HF's gradient_checkpointing, older forks) every
    # block's Linears first run without grad; a target computed under no_grad through the same
    # layer likewise: their output gradients, grad-input and grad-weight GEMMs were never measured
    import ampaudit

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.proj = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            return x + self.proj(torch.relu(self.fc(x)))

    class Net(nn.Module):
        def __init__(self, how):
            super().__init__()
            self.how, self.block, self.head = how, Block(), nn.Linear(32, 16)

        def forward(self, x):
            if self.how == "reentrant_checkpoint":
                h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=True)
            else:
                if self.how == "no_grad":
                    with torch.no_grad():
                        self.block(x * 2)
                h = self.block(x)
            return self.head(h)

    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0)).requires_grad_(
        first_call == "reentrant_checkpoint")  # reentrant checkpointing needs an input that requires grad
    reports = []
    for how in ("plain", first_call):
        torch.manual_seed(0)
        report = ampaudit.check(Net(how), (x,), dtype="fp8").fp8
        report.pop("seconds")
        reports.append(report)
    gemms = [[layer.pop("gemms") for layer in report["layers"]] for report in reports]
    assert reports[1]["layers"] == reports[0]["layers"]
    # a layer called twice has its products recomputed from its input: the same to fp32's rounding
    assert all(set(g) == {"output", "grad_input", "grad_weight"} for g in gemms[1])
    assert gemms[1] == [pytest.approx(g, abs=1e-4) for g in gemms[0]]


def test_the_model_output_sqnr_is_over_the_outputs_that_depend_on_the_weights():
    # an output the weights do not change (the input passed through, a count) is exact in fp8: it
    # entered the model output's SQNR (37.3 dB where the logits alone keep 29.4) and could lift
    # the output past AMP705's max_output_sqnr_db
    import ampaudit

    class Net(nn.Module):
        def __init__(self, passthrough):
            super().__init__()
            self.passthrough = passthrough
            self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            out = {"logits": self.c(torch.relu(self.b(torch.relu(self.a(x)))))}
            if self.passthrough:
                out.update(embeddings=x * 10, tokens=torch.tensor(float(x.shape[1])))
            return out

    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    found = []
    for passthrough in (False, True):
        torch.manual_seed(0)
        report = ampaudit.check(Net(passthrough), (x,), dtype="fp8").fp8
        found.append((report["output_sqnr_db"], report["output_sqnr_without_db"]))
    assert found[1] == found[0] and 20 < found[1][0] < 40


def test_operand_sqnr_past_float32s_squares_is_the_same_as_at_any_power_of_two_scale():
    # a finite input of ~1e25 has squares past float32's max: its SQNR read -inf under every
    # recipe and the layer passed as fp8; every cast is scale-free for a power of two
    from ampaudit.graph.forward import ExampleInputs
    from ampaudit.graph.fp8_measure import measure_fp8

    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    found = []
    for scale in (1.0, 2.0 ** 80):
        torch.manual_seed(0)
        m = measure_fp8(nn.Sequential(nn.Linear(32, 32, bias=False)), ExampleInputs.coerce((x * scale,), "x"),
                        "tensorwise")
        found.append({r: ops["input"].sqnr_db for r, ops in m.layers[0].operands.items()})
    # the same casts; the sums of squares in float64 past float32's range, to its rounding
    assert found[1] == pytest.approx(found[0], abs=1e-5) and all(20 < v < 40 for v in found[0].values())


def test_a_non_finite_fp32_operand_is_one_line_not_a_minus_inf_sqnr(cli, tmp_path):
    model = tmp_path / "m.py"
    model.write_text("import torch\nfrom torch import nn\n\n\ndef get_model():\n    return nn.Sequential("
                     "nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))\n\n\ndef example_inputs():\n"
                     "    x = torch.randn(4, 16)\n    x[0, 0] = float('inf')\n    return (x,)\n")
    result = cli("check", model, "--dtype", "fp8")
    assert result.code == 2
    assert result.err == ("ampaudit: error: the fp32 forward and backward on the example inputs give nn.Linear '0' "
                          "a non-finite input (inf or NaN): fp8 cannot be measured against it\n")


def _encoder(frozen):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True, dropout=0.0)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    encoder.requires_grad_(not frozen)
    return nn.Sequential(encoder, nn.Linear(32, 32)) if frozen else encoder


def test_a_transformer_encoders_linears_run_in_fp8_in_its_eval_forward_and_are_recorded_when_frozen():
    # nn.TransformerEncoderLayer's fast path (eval, no grad) computes linear1/linear2 in one fused
    # kernel without calling them: the fp8 forward ran them in fp32 (the output read 135 dB with
    # all four 'in fp8'); the recording of a frozen encoder (no parameter needing grad) runs them too
    import ampaudit

    x = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(0))
    report = ampaudit.check(_encoder(frozen=False), (x,), dtype="fp8", fp8_recipe="mxfp8").fp8
    assert [layer["verdict"] for layer in report["layers"]] == ["fp8"] * 4
    assert 20 < report["output_sqnr_db"] < 40
    frozen = ampaudit.check(_encoder(frozen=True), (x,), dtype="fp8").fp8
    assert [layer["name"] for layer in frozen["layers"]] == [
        "0.layers.0.linear1", "0.layers.0.linear2", "0.layers.1.linear1", "0.layers.1.linear2", "1"]
    assert torch.backends.mha.get_fastpath_enabled()  # as it was


def test_a_model_converted_with_torchao_already_is_measured_as_the_fp32_model_it_was():
    # its Float8Linears ran in the "fp32" reference: the model output read inf dB (the emulation
    # equals what it is compared with) and each GEMM was compared with an fp8 product
    import ampaudit

    config_cls, convert = _torchao()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    converted = copy.deepcopy(plain)
    convert(converted, config=dataclasses.replace(config_cls.from_recipe_name("tensorwise"), emulate=True))
    assert type(converted[0]).__name__ == "Float8Linear"
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(0))
    reports = [ampaudit.check(m, (x,), dtype="fp8").fp8 for m in (plain, converted)]
    for report in reports:
        report.pop("seconds")
    assert reports[1] == reports[0] and 20 < reports[1]["output_sqnr_db"] < 40


def test_convert_refuses_a_model_converted_already_in_one_line(cli, tmp_path):
    # its "bf16 autocast" copy trained in fp8 too, so the training check compared fp8 with fp8 and
    # passed, and the emitted file converted the model a second time
    _torchao()
    model = tmp_path / "m.py"
    model.write_text(
        "import dataclasses\nimport torch\nfrom torch import nn\n"
        "from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n\n\n"
        "def get_model():\n    m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))\n"
        "    config = dataclasses.replace(Float8LinearConfig.from_recipe_name('tensorwise'), emulate=True)\n"
        "    return convert_to_float8_training(m, config=config)\n")
    out = tmp_path / "out"
    result = cli("convert", model, "--dtype", "fp8", "--emit", "torchao", "--input-shape", "4,16", "-o", out)
    assert result.code == 2 and not out.exists()
    assert result.err == ("ampaudit: error: the model is converted to float8 already (torchao's Float8Linear: `0`, "
                          "`2`): give convert the model before convert_to_float8_training\n")


class _TopKRouter(nn.Module):  # shaped like transformers 5's MixtralTopKRouter: a weight read with F.linear
    def __init__(self, experts, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, dim) * 0.1)

    def forward(self, x):
        return nn.functional.linear(x, self.weight).softmax(-1)


class _Experts(nn.Module):  # and like its MixtralExperts: every expert's weight stacked in one 3-D parameter
    def __init__(self, experts, dim):
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, 2 * dim, dim) * 0.1)
        self.down = nn.Parameter(torch.randn(experts, dim, 2 * dim) * 0.1)

    def forward(self, x, weights):
        out = 0
        for e in range(self.up.shape[0]):
            h = nn.functional.linear(torch.relu(nn.functional.linear(x, self.up[e])), self.down[e])
            out = out + h * weights[..., e:e + 1]
        return out


class _Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(1, 8, 16))  # a (1, N, D) position table: no GEMM
        self.router, self.experts, self.head = _TopKRouter(4, 16), _Experts(4, 16), nn.Linear(16, 16)

    def forward(self, x):
        x = x + self.pos
        return self.head(self.experts(x, self.router(x)))


def test_moe_experts_and_routers_are_named_in_the_note_of_gemms_not_audited():
    # a Mixtral from transformers 5: "9 nn.Linear: 9 fp8" and no word of its experts, most of its GEMMs
    import ampaudit

    torch.manual_seed(0)
    report = ampaudit.check(_Moe(), (torch.randn(2, 8, 16),), dtype="fp8")
    assert [layer["name"] for layer in report.fp8["layers"]] == ["head"]
    assert ("not audited: 1 MoE experts module (3-D expert weights), 1 MoE router - not nn.Linear, so torchao's "
            "convert_to_float8_training leaves them in high precision (they train as they do today)"
            in report.target.notes)


def test_a_policy_that_keeps_every_linear_says_it_converts_nothing_and_why(cli, tmp_path):
    # GPT-2's shape: convolutions (transformers Conv1D there) do the work, the one Linear has
    # odd dims; the summary said "fp8: 0 nn.Linear" and nothing of the rest
    model = tmp_path / "m.py"
    model.write_text("from torch import nn\n\n\ndef get_model():\n"
                     "    return nn.Sequential(nn.Conv1d(4, 16, 1), nn.Flatten(), nn.Linear(128, 10))\n")
    _torchao()
    result = cli("convert", model, "--dtype", "fp8", "--emit", "torchao", "--input-shape", "2,4,8",
                 "--train-steps", "0", "-o", tmp_path / "out")
    text = " ".join(result.out.replace("│", " ").split())
    assert result.code == 0
    assert "fp8 0 nn.Linear: the file converts nothing, every Linear stays in bf16" in text
    assert ("note not audited: 1 convolution - not nn.Linear, so torchao's convert_to_float8_training leaves "
            "them in high precision") in text


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_dequantizing_every_fp8_code_equals_torchs_conversion_and_division(fmt):
    """casts move e4m3's bits into float16's places (torch's e4m3 -> float32 is 5x slower) and
    fold the 2^8 between the exponent biases into the scale: every finite code, subnormals
    too, under scales whose fold is exact and scales where it would not be."""
    from ampaudit.graph.fp8_casts import _dequantize

    codes = torch.arange(256, dtype=torch.uint8).view(fmt)
    finite = codes[torch.isfinite(codes.float())].reshape(-1, 1)
    for scale in (1.0, 3.7, 448.0 / 7.1e-3, 2.0**-120, 2.0**-118, 2.0**100, 2.0**125):
        s = torch.tensor(scale, dtype=torch.float32)
        mine = _dequantize(finite, s, torch.empty(finite.shape))
        assert torch.equal(mine.view(torch.int32), (finite.float() / s).view(torch.int32)), scale
        mine = _dequantize(finite, s, torch.empty(finite.shape), divide=False)
        assert torch.equal(mine.view(torch.int32), (finite.float() * s).view(torch.int32)), scale


class _Chain(nn.Module):
    """Four Linears in a row, the second's output changed in place (``inplace``) or not."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(32, 32) for _ in range(4))
        self.inplace = inplace

    def forward(self, x):
        y = self.b(torch.tanh(self.a(x)))
        y = y.mul_(0.5) if self.inplace else y * 0.5
        return self.d(torch.tanh(self.c(torch.tanh(y))))


@pytest.mark.parametrize("inplace", [False, True])
def test_dominance_replays_the_first_forwards_calls_up_to_the_dominant_layer(monkeypatch, inplace):
    """The second dominance forward (all but the worst layer in fp8) takes the first one's
    outputs for the calls before the worst layer's: the same output SQNRs as two whole
    forwards, fewer input casts; an output changed in place since is not reused. Both take
    each weight's cast from the measurement (every layer here is measured whole): the same
    bits as casting it again."""
    from ampaudit.graph import fp8_measure
    from ampaudit.graph.forward import ExampleInputs

    torch.manual_seed(0)
    model = _Chain(inplace).eval()
    inputs = ExampleInputs.coerce((torch.randn(8, 32, generator=torch.Generator().manual_seed(0)),), "x")
    m = fp8_measure.measure_fp8(model, inputs, "tensorwise")
    for layer in m.layers:  # make c the worst: the second forward re-runs c (fp32) and d only
        layer.gemms["output"] = 10.0 if layer.name == "c" else 30.0
    recipe = RECIPES["tensorwise"]
    kept = {name: m.weight_cast[id(mod)].value for name, mod in model.named_children()}
    for name, value in kept.items():
        fresh = fp8_measure.cast(getattr(model, name).weight.detach().t(), recipe.weight, 0, pow2=False, count=False)
        assert torch.equal(value.view(torch.int32), fresh.value.view(torch.int32)), name
    calls = []
    real_cast = fp8_measure.cast
    monkeypatch.setattr(fp8_measure, "cast", lambda t, *a, **k: calls.append(t.shape) or real_cast(t, *a, **k))
    replays, real_replay = [], fp8_measure._Replay
    monkeypatch.setattr(fp8_measure, "_Replay", lambda *a: replays.append(real_replay(*a)) or replays[-1])
    fp8_measure.dominance(model, inputs, m, ["a", "b", "c", "d"])
    assert m.dominant == "c"
    # the first forward kept the calls up to c's, not d's: the second runs d anew
    assert sorted(name for name, mod in model.named_children()
                  if any(key[0] == id(mod) for key in replays[0].calls)) == ["a", "b", "c"]
    # first forward: 4 inputs; second: d's input; with b's output halved in place, b's is not
    # reused: b's input too. No weight is cast again: the forwards take the measurement's casts
    assert calls == [(8, 32)] * (6 if inplace else 5)
    assert m.weight_cast == {}  # held only until the forwards
    whole = [sqnr_db(m.reference, fp8_measure.fp8_forward(model, inputs, names, recipe))
             for names in ({"a", "b", "c", "d"}, {"a", "b", "d"})]
    assert (m.output_sqnr_db, m.output_sqnr_without_db) == tuple(whole)
    assert 20 < m.output_sqnr_db < m.output_sqnr_without_db < 60


def test_the_recording_backward_skips_weight_gradients_and_keeps_every_output_gradient_bit_for_bit():
    """record() runs plain Linears without their weight gradient (a third of their GEMMs): each
    recorded output gradient is autograd's own, bit for bit, a column-major input's too; a
    subclass with its own forward and a forward wrapped on the instance run as written; the
    user's .grad are left as they were."""
    from ampaudit.graph.forward import ExampleInputs
    from ampaudit.graph.fp8_measure import record

    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2.0

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(24, 40), nn.Linear(40, 24, bias=False)
            self.c = Scaled(24, 16)

        def forward(self, x):
            h = self.a(x.t())  # a column-major input
            return self.c(torch.tanh(self.b(torch.tanh(h)))).unsqueeze(0)

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(24, 12, generator=torch.Generator().manual_seed(0))
    wrapped = net.b.forward

    def hooked(h):  # as accelerate's hooks wrap a module's forward: left as it is
        return wrapped(h)

    net.b.forward = hooked
    grads = {}

    def keep(name):
        def hook(module, args, out):
            out.register_hook(lambda g: grads.setdefault(name, g.clone()))
        return hook

    handles = [getattr(net, name).register_forward_hook(keep(name)) for name in ("a", "b", "c")]
    (net(x).square().mean()).backward()
    for h in handles:
        h.remove()
    user = {n: p.grad.clone() for n, p in net.named_parameters()}
    records, _, _ = record(net, ExampleInputs.coerce((x,), "x"))
    for name in ("a", "b", "c"):
        assert torch.equal(records[name].grad, grads[name].reshape(-1, grads[name].shape[-1])), name
    assert records["a"].grad_weight is None
    assert records["b"].grad_weight is not None and records["c"].grad_weight is not None
    assert all(torch.equal(p.grad, user[n]) for n, p in net.named_parameters())
    assert "forward" not in vars(net.a) and vars(net.b)["forward"] is hooked


def test_the_recording_keeps_each_layers_grad_input_product_only_for_the_gradient_it_recorded():
    """The recording's backward keeps ``grad @ W`` (the measurement's grad-input reference of a
    layer measured whole) bit for bit as the measurement would compute it, and only where its
    gradient is the one recorded: a forward hook that returns a new output (a massive first
    token) gives the Linear another gradient than the hooked output's; a column-major input's
    product is computed transposed."""
    from ampaudit.graph.forward import ExampleInputs
    from ampaudit.graph.fp8_measure import record

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(24, 40), nn.Linear(40, 40), nn.Linear(40, 8)

        def forward(self, x):
            return self.c(torch.tanh(self.b(torch.tanh(self.a(x.t())))))

    def sink(module, args, out):
        out = out.clone()
        out[0] = out[0] * 300.0
        return out

    torch.manual_seed(0)
    net = Net()
    net.b.register_forward_hook(sink)
    records, _, _ = record(net, ExampleInputs.coerce((torch.randn(24, 12),), "x"))
    assert records["a"].grad_input is None  # column-major input
    assert records["b"].grad_input is None  # the hook's output is not the Linear's
    kept = records["c"].grad_input
    fresh = torch.mm(records["c"].grad, records["c"].module.weight.detach())
    assert kept is not None and torch.equal(kept.view(torch.int32), fresh.view(torch.int32))


def test_a_linear_no_hook_runs_around_records_itself_what_the_hooks_recorded():
    """A plain Linear with no hook of its own (and no global module hook) is recorded by its
    recording forward and backward, not by module and tensor hooks (which put every call on
    nn.Module's slow path): the same calls counted, the same input, output and line kept - the
    first call with a gradient, else the first without -, the same permuted-view note, the same
    output gradient (the very tensor autograd gave) and grad-input product, bit for bit."""
    from ampaudit.graph.forward import ExampleInputs
    from ampaudit.graph.fp8_measure import record

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(8, 8), nn.Linear(16, 16)

        def forward(self, x):
            with torch.no_grad():
                self.c(x)  # a first call without a gradient: replaced by the one with it
            y = self.a(torch.tanh(self.a(input=x)))  # called twice, by keyword first
            z = self.b(y.transpose(1, 2))  # a permuted view (2, 16, 8)
            return self.c(y) + z.sum()

    torch.manual_seed(0)
    net = Net()
    inputs = ExampleInputs.coerce((torch.randn(2, 8, 16),), "x")
    direct, ref_direct, _ = record(net, inputs)
    handles = [m.register_forward_hook(lambda *_: None) for m in (net.a, net.b, net.c)]
    hooked, ref_hooked, _ = record(net, inputs)
    for h in handles:
        h.remove()
    assert torch.equal(ref_direct, ref_hooked)
    same = ("calls", "file", "line", "permuted", "with_grad", "own_difference", "out_version")
    for name in ("a", "b", "c"):
        d, h = direct[name], hooked[name]
        assert [getattr(d, k) for k in same] == [getattr(h, k) for k in same], name
        for k in ("x", "out", "grad"):
            assert torch.equal(getattr(d, k).view(torch.int32), getattr(h, k).view(torch.int32)), (name, k)
        assert (d.grad_input is None) == (h.grad_input is None), name
        if d.grad_input is not None:
            assert torch.equal(d.grad_input.view(torch.int32), h.grad_input.view(torch.int32)), name
    assert (direct["a"].calls, direct["c"].calls, direct["c"].with_grad) == (2, 2, True)
    assert direct["b"].permuted == "shape (2, 16, 8), strides (128, 1, 16)" and direct["a"].permuted is None
    assert direct["a"].line and direct["a"].file == __file__


def test_a_high_precision_grad_weight_gemm_is_its_own_reference():
    """Under rowwise_with_gw_hp the grad-weight GEMM runs in high precision: its product is the
    fp32 reference's (the same operands, the same mm), so the measurement multiplies once, not
    twice, and the SQNR is inf as before; the other recipes compute the reference."""
    from ampaudit.graph.forward import ExampleInputs
    from ampaudit.graph.fp8_measure import measure_fp8

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 16))
    inputs = ExampleInputs.coerce((torch.randn(64, 32),), "x")
    calls = {}
    mm = torch.mm
    for recipe in ("rowwise", "rowwise_with_gw_hp"):
        count = [0]

        def counted(*args, count=count, **kwargs):
            count[0] += 1
            return mm(*args, **kwargs)

        torch.mm = counted
        try:
            m = measure_fp8(model, inputs, recipe)
        finally:
            torch.mm = mm
        calls[recipe] = count[0]
        gw = [layer.gemms["grad_weight"] for layer in m.layers]
        assert all(math.isfinite(v) for v in gw) if recipe == "rowwise" else gw == [math.inf, math.inf]
    # per layer: output, grad-input, grad-weight, and rowwise's grad-weight reference (the
    # grad-input reference is the recording's own product)
    assert calls == {"rowwise": 8, "rowwise_with_gw_hp": 6}


def test_the_measurements_scratch_lends_a_larger_buffer_in_the_layout_torch_gives():
    """A buffer given back serves a smaller tensor of another shape (viewed from its start); a
    difference of two tensors of different layouts is written in the layout ``a - b`` has - the
    same values and strides, so the same norms."""
    from ampaudit.graph.fp8_measure import _difference_layout, _Scratch

    n = _Scratch.SHARED
    a, t = torch.randn(64, n // 32), torch.randn(n // 32, 64).t()
    for x, y in ((a, a.clone()), (a, t), (t, a), (t, t.clone()), (a, torch.randn(n // 32)), (t, torch.randn(64, 1))):
        layout = _difference_layout(x, y)
        assert layout is not None and (layout[0], layout[1]) == ((x - y).shape, (x - y).stride())
    assert _difference_layout(a[:, ::2], a[:, ::2]) is None  # not dense
    scratch = _Scratch()
    big = torch.empty(2 * n)
    scratch.give(big)
    got = scratch.sub(t, a)
    assert got.data_ptr() == big.data_ptr() and got.stride() == (t - a).stride()
    assert torch.equal(got, t - a) and float(torch.linalg.vector_norm(got)) == float(torch.linalg.vector_norm(t - a))
    scratch.give(got)
    product = scratch.mm(torch.randn(n // 32, 64), torch.randn(64, 64))
    assert product.data_ptr() == big.data_ptr() and product.is_contiguous()
    assert scratch.take(torch.empty(8, 8)) is None  # small: none lent past its own shape


class _LayerScaleInPlace(nn.Module):
    """timm's LayerScale(inplace=True) after a Linear of a 3-D input: `x.mul_(gamma)`."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 16)
        self.gamma = nn.Parameter(torch.full((16,), 0.1))

    def forward(self, x):
        return self.head(self.fc(x).mul_(self.gamma))


def test_an_in_place_op_on_a_linears_output_is_audited():
    # the recording pass's input-gradient-only Linear returned linear's view of its 2-D
    # product, and autograd forbids in-place ops on a custom Function's views: exit 2
    import ampaudit

    torch.manual_seed(0)
    report = ampaudit.check(_LayerScaleInPlace(), (torch.randn(2, 8, 16),), dtype="fp8")
    assert [layer["name"] for layer in report.fp8["layers"]] == ["fc", "head"]
    assert all(layer["verdict"] == "fp8" for layer in report.fp8["layers"])


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("amax", [[0.0], [3.0, 0.0, 448.0], [1.0, NAN], [INF], [2.0, INF, 1.0], [NAN, INF], [3.4e38]])
def test_finite_reads_the_amaxs_max_as_isfinite_all_did(amax):
    """fp8_casts._finite (which dequantization path a cast takes) reads the max of the amaxes
    (each >= 0 or NaN; max propagates NaN) where it ran isfinite(t).all(): the same answer."""
    from ampaudit.graph.fp8_casts import _finite

    for t in (torch.tensor(amax), torch.tensor(amax).reshape(-1, 1), torch.tensor(amax[0])):
        assert _finite(t) == bool(torch.isfinite(t).all()), t


def test_sampled_flush_counts_by_bool_conversion_equal_the_comparisons():
    """_signal and _sampled_stats count nonzero and flushed elements from ``x.bool()`` and
    ``nonzero > q.bool()`` (4-6x faster here than ``x != 0`` and ``(q == 0) & nonzero``), per
    row in int32: the same shares with zeros, negative zeros and NaN in x and in the cast, rows
    weighted and not."""
    from ampaudit.graph.fp8_measure import _Axis, _sampled_stats, _signal

    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 40, generator=g)
    x[x.abs() < 0.3] = 0.0
    x[0, :5] = -0.0
    x[1, 3] = float("nan")
    value = x.clone()
    value[value.abs() < 0.6] = 0.0
    value[2, :4] = -0.0
    q = CastResult(value, 0, 0, 0)
    rows = _Axis(None, torch.rand(16, generator=g) * 3)
    for r, c in ((rows, _Axis()), (_Axis(), _Axis())):
        signal = _signal(x, None, r, c)
        stats = _sampled_stats(x, q, signal, None, r, c)
        nonzero, flushed = (x != 0), (value == 0) & (x != 0)
        if r.weight is None:
            total, lost = float(nonzero.sum()), float(flushed.sum())
        else:
            total, lost = (float((m.sum(dim=1) * r.weight).sum()) for m in (nonzero, flushed))
        assert signal.total == total
        assert stats.flushed == lost / total


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
def test_a_per_tensor_cast_with_the_wholes_amax_needs_no_clamp(fmt, pow2):
    """cast() with a caller's amax (a sample's whole tensor's, at least every |x|) skips torchao's
    clamp to +-fmax: x * fp32(fmax / amax) exceeds fmax by an ulp at most, which the cast rounds to
    fmax. The same bits as with the clamp: elements at the amax, the sample's own max below it,
    amaxes below torchao's floor (1e-12), magnitudes over 80 octaves."""
    from ampaudit.graph.fp8_casts import _scale

    g = torch.Generator().manual_seed(5)
    how = Cast(fmt, TENSOR)
    for _ in range(200):
        octave = float(torch.randint(-60, 20, (), generator=g))
        x = torch.randn(8, 16, generator=g) * 2.0 ** octave
        whole = x.abs().max() * float(torch.rand((), generator=g) * 3 + 1)  # at least every |x|
        for amax in (x.abs().max(), whole, torch.tensor(1e-13)):
            sample = x if amax >= x.abs().max() else x / x.abs().max() * 1e-13  # under the floor too
            scale = _scale(amax, fmt, pow2)
            q8 = (sample * scale).clamp(-fmt.max, fmt.max).to(fmt.torch)
            expected = q8.float() / scale
            got = cast(sample, how, 0, pow2=pow2, amax=amax, count=False).value
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (octave, float(amax))


def test_torchaos_import_time_log_lines_stay_out_of_a_check_of_an_hf_model():
    # transformers imports torchao while it builds the model: "Failed to load .../_C_mxfp8...so" and
    # torch's pytree deprecation, four lines on every `check hf:...` where ampaudit[fp8] is installed
    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    result = subprocess.run([sys.executable, "-m", "ampaudit", "check", "hf:llama", "--format", "json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode in (0, 1) and result.stderr == "", result.stderr[-2000:]


@pytest.mark.parametrize("target, extra", [
    ("hf:llama", ()),  # rebuilt from its transformers config, the token ids loaded from fp8_inputs.pt
    ("torch.nn:Sequential(Linear(64, 32), GELU(), Linear(32, 16))", ("--input-shape", "4,64")),
])
def test_a_model_without_a_file_is_rebuilt_by_the_emitted_file_which_repeats_the_verification(
        cli, tmp_path, target, extra):
    # it said "this policy was made for a model without a file: call verify(model, inputs) yourself"
    _torchao()
    if target.startswith("hf:"):
        pytest.importorskip("transformers")
    out = tmp_path / "out"
    result = cli("convert", target, "--dtype", "fp8", "--emit", "torchao", "--train-steps", "4", "-o", out, *extra)
    assert result.code == 0, result.err
    plan = json.loads((out / "fp8_plan.json").read_text())
    _runs_as_written(out, plan, tmp_path)


def test_inputs_the_emitted_file_cannot_load_back_are_not_saved_and_running_it_says_so(cli, tmp_path):
    _torchao()
    model_file = tmp_path / "flagged.py"
    model_file.write_text(
        "import torch\nfrom torch import nn\n\n\nclass Flags:\n    scale = 2.0\n\n\n"
        "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = nn.Linear(32, 32)\n\n"
        "    def forward(self, x, flags):\n        return self.fc(x) * flags.scale\n\n\n"
        "def example_inputs():\n    return (torch.randn(32, 32), Flags())\n")
    out = tmp_path / "out"
    result = cli("convert", model_file, "--dtype", "fp8", "--emit", "torchao", "--train-steps", "2", "-o", out)
    assert result.code == 0, result.err
    assert not (out / "fp8_inputs.pt").exists() and json.loads((out / "fp8_plan.json").read_text())["train"]["passed"]
    run = subprocess.run([sys.executable, str(out / "fp8_torchao.py")], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    assert run.returncode == 1 and "fp8_inputs.pt is not beside this file" in run.stderr


def test_a_model_torchao_cannot_train_as_written_fails_the_check_in_one_line_naming_its_line(cli, tmp_path):
    # transformers' Falcon adds into its MLP's output in place; torchao's Float8Linear returns a view
    # from a custom Function, which autograd forbids modifying: it was "unexpected RuntimeError", exit 2
    _torchao()
    model_file = tmp_path / "inplace.py"
    model_file.write_text(
        "import torch\nfrom torch import nn\n\n\nclass Net(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.fc = nn.Linear(32, 32, bias=False)\n\n    def forward(self, x):\n"
        "        out = self.fc(x)\n        out += x\n        return out\n\n\n"
        "def example_inputs():\n    return (torch.randn(2, 16, 32),)\n")  # 3-D: the output is a reshaped view
    out = tmp_path / "out"
    result = cli("convert", model_file, "--dtype", "fp8", "--emit", "torchao", "--train-steps", "2", "-o", out)
    assert result.code == 1 and result.err.count("\n") == 1, result.err
    assert "training the model in fp8 with torchao (tensorwise) failed: RuntimeError: Output 0 of " in result.err
    assert "--fp8-recipe tensorwise" not in result.err  # the recipe that failed is the one it would suggest
    assert f"({model_file.name}:12)" in result.err or "inplace.py:12)" in result.err
    assert not out.exists()


_TRANSPOSED = ("import torch\nfrom torch import nn\n\n\nclass Net(nn.Module):\n    def __init__(self):\n"
               "        super().__init__()\n        self.fc = nn.Linear(32, 32)\n"
               "        self.fc2 = nn.Linear(32, 16)\n\n"
               "    def forward(self, x):\n        return self.fc2(self.fc(x.transpose(1, 2)))\n\n\n"
               "def example_inputs():\n    return (torch.randn(2, 32, 16),)\n")


def test_a_linear_fed_a_transposed_view_is_kept_in_bf16_under_rowwise_and_the_rest_trains(cli, tmp_path):
    """timm's LeViT and MLP-Mixer apply a Linear to a transposed input: torchao's rowwise recipes
    raise "aten.clone.default with axiswise scaling is not supported yet" on it (AMP708). convert
    keeps that layer in bf16 under them and trains the rest; tensorwise converts both."""
    _torchao()
    model_file = tmp_path / "transposed.py"
    model_file.write_text(_TRANSPOSED)
    out = tmp_path / "out"
    result = cli("convert", model_file, "--dtype", "fp8", "--fp8-recipe", "rowwise", "--emit", "torchao",
                 "--train-steps", "2", "-o", out)
    assert result.code == 0, result.err
    plan = json.loads((out / "fp8_plan.json").read_text())
    assert plan["fp8"] == ["fc2"] and list(plan["keep"]) == ["fc"]
    assert plan["keep"]["fc"] == "AMP708: its input is a permuted view: torchao's rowwise cannot reshape it"
    result = cli("convert", model_file, "--dtype", "fp8", "--fp8-recipe", "tensorwise", "--emit", "torchao",
                 "--train-steps", "2", "-o", tmp_path / "tw")
    assert result.code == 0, result.err
    assert json.loads((tmp_path / "tw" / "fp8_plan.json").read_text())["fp8"] == ["fc", "fc2"]


def test_a_recipe_torchao_cannot_run_on_the_model_names_the_one_that_runs_most(cli, tmp_path, monkeypatch):
    """A failure the audit did not foresee (here AMP708's layout test switched off): the training
    check's one line says which recipe failed and names tensorwise."""
    _torchao()
    from ampaudit.graph import fp8_measure

    monkeypatch.setattr(fp8_measure, "permuted_rows", lambda x: None)
    model_file = tmp_path / "transposed.py"
    model_file.write_text(_TRANSPOSED)
    out = tmp_path / "out"
    result = cli("convert", model_file, "--dtype", "fp8", "--fp8-recipe", "rowwise", "--emit", "torchao",
                 "--train-steps", "2", "-o", out)
    assert result.code == 1 and result.err.count("\n") == 1, result.err
    assert "training the model in fp8 with torchao (rowwise) failed: AssertionError: aten.clone.default" in result.err
    assert "(another recipe may train it: --fp8-recipe tensorwise; --train-steps 0 writes" in result.err
    assert not out.exists()


# each input layout: (how it is made from a contiguous (4, 32, 32) tensor, whether torchao's rowwise takes it)
_LAYOUTS = {
    "contiguous": (lambda b: b, True),
    "transposed": (lambda b: b.transpose(1, 2), False),
    "batch_first_swapped": (lambda b: b.transpose(0, 1), False),
    "sliced_features": (lambda b: torch.cat([b, b], -1)[..., :32], True),  # not dense: a cast's output is contiguous
    "strided_tokens": (lambda b: b[:, ::2], True),
    "expanded": (lambda b: b[:1].expand(4, 32, 32), True),
    "matrix_transposed": (lambda b: b[0].t(), True),  # 2-D: no reshape
    "channels_last": (lambda b: b.reshape(4, 32, 4, 8).permute(0, 2, 3, 1), False),
    "transposed_then_sliced": (lambda b: b.transpose(1, 2)[:, :16], False),
    "transposed_one_batch": (lambda b: b[:1].transpose(1, 2), True),  # viewable as rows all the same
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_amp708s_layout_test_is_what_torchaos_rowwise_linear_takes(layout):
    config_cls, convert = _torchao()
    from ampaudit.graph.fp8_measure import permuted_rows

    make, takes = _LAYOUTS[layout]
    x = make(torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(0))).detach().requires_grad_()
    fp8 = nn.Sequential(nn.Linear(32, 16))
    convert(fp8, config=dataclasses.replace(config_cls.from_recipe_name("rowwise"), emulate=True))
    try:
        fp8(x).sum().backward()
        ran = True
    except AssertionError as exc:
        assert "axiswise scaling is not supported" in str(exc)
        ran = False
    assert ran is takes
    assert (permuted_rows(x) is None) is takes


def test_massive_tokens_in_a_permuted_input_advise_per_row_scales_with_what_they_need(cli, tmp_path):
    """AMP702's advice is per-row scales; for a Linear fed a permuted view (AMP708) torchao's
    rowwise recipes fail, so the message says the input must be made contiguous first."""
    model_file = tmp_path / "permuted_tokens.py"
    model_file.write_text(
        "import torch\nfrom torch import nn\n\n\nclass Net(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.fc = nn.Linear(32, 32)\n\n    def forward(self, x):\n"
        "        return self.fc(x.transpose(1, 2))\n\n\n"
        "def example_inputs():\n    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0))\n"
        "    x[:, :, 0] *= 30000.0  # token 0 of the transposed input: a massive activation\n    return (x,)\n")
    result = cli("check", model_file, "--dtype", "fp8", "--format", "json")
    report = json.loads(result.out)
    (finding,) = [f for f in report["findings"] if f["rule"] == "AMP702"]
    assert finding["message"].endswith("use per-row scales (rowwise_with_gw_hp) or keep it in bf16; its input is a "
                                       "permuted view, which torchao's rowwise recipes cannot take (AMP708): make it "
                                       "contiguous before the layer")
    rowwise = json.loads(cli("check", model_file, "--dtype", "fp8", "--fp8-recipe", "rowwise",
                             "--format", "json").out)
    assert [f["rule"] for f in rowwise["findings"]] == ["AMP708"]
