"""An in-place op keeps its target's dtype (graph/dtype_flow.py): LongT5's ``scores +=
position_bias`` writes an fp32 bias holding -1e10 into fp16 scores, -inf there. Taken for a
promoting add (fp32, as its bias), its overflow was nobody's: ``check hf:longt5``-shaped code got
no AMP301, and convert left the add low, so its training check skipped every step (NaN
gradients from whole masked rows that the model then drops)."""

import torch

import ampaudit
from ampaudit.core.config import Config
from fixtures.models import inplace_mask_bias
from tests.conftest import line_of, model

FIXTURE = model("inplace_mask_bias.py")


def test_check_reports_the_overflow_where_the_in_place_add_stores_it_low():
    report = ampaudit.check(inplace_mask_bias.get_model(), inplace_mask_bias.example_inputs(),
                            config=Config(fail_on="never"))
    found = [(f.rule, f.line, f.message) for f in report.findings if f.rule == "AMP301"]
    assert found == [("AMP301", line_of(FIXTURE, "scores += position_bias"),
                      "max |x| = 1e+10 exceeds float16 max 65504 (31.2% of values overflow to inf on the example "
                      "inputs)")]


def test_check_reports_the_overflow_where_autocast_runs_the_add_low_behind_a_t5_norm():
    """LongT5's norm returns fp32 in an fp32 recording (its cast back to the weight's dtype is a
    branch on that dtype), so a model cast to float16 would run the attention in fp32 and the
    in-place add with it: the overflow was nobody's in that view, and ``check hf:longt5`` said
    nothing. Autocast runs the projections, the einsum and so the add low all the same: an
    overflow measured where autocast computes low is reported there too."""
    report = ampaudit.check(inplace_mask_bias.get_normed_model(), inplace_mask_bias.example_inputs(),
                            config=Config(fail_on="never"))
    found = [(f.rule, f.line, f.module) for f in report.findings if f.rule.startswith("AMP3")]
    assert found == [("AMP301", line_of(FIXTURE, "scores += position_bias"), "attn")]


def test_convert_keeps_the_in_place_add_in_fp32_and_trains():
    net, inputs = inplace_mask_bias.get_model(), inplace_mask_bias.example_inputs()
    # plain autocast: the forward is finite, every gradient of the attention NaN
    with torch.autocast("cpu", dtype=torch.float16):
        net(*inputs).float().square().mean().backward()
    assert not torch.isfinite(net.attn.qkv.weight.grad).all()
    net.zero_grad()
    model_mp, _ = ampaudit.convert(net, torch.optim.AdamW(net.parameters(), lr=1e-3), example_inputs=inputs)
    add = [(r["compute"], r["rule"]) for r in model_mp.plan if r["node"].startswith("add_") and r["kind"] == "add"
           and r["line"] == line_of(FIXTURE, "scores += position_bias")]
    assert add == [("float32", "AMP301")]
    train = model_mp.summary.train
    assert train["skipped"] == 0 and len(train["converted"]) == 20 and train["worst"] <= train["tolerance"]
