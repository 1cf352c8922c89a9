"""watch's verdicts (AMP6xx): exact findings from real CPU training runs, the same live and from
the log, with and without a log (conditions tracked on the device), and in report's formats."""

from __future__ import annotations

import io
import json
import random
import re

import pytest
import torch
from torch import nn

import ampaudit
from ampaudit.core.dtypes import LowDtype
from ampaudit.core.findings import Severity
from ampaudit.core.rulebook import RuleInfo, rulebook
from ampaudit.watch import conditions, cpu_kernel, reducer, rule_api, stats, verdicts
from ampaudit.watch.layout import LAYOUT
from ampaudit.watch.rule_api import (
    REGISTRY,
    Condition,
    GradientRule,
    LayerRule,
    Verdict,
    maximum,
    minimum,
    runtime_rule,
    steps_text,
    where,
)
from ampaudit.watch.summary import SummaryBuilder, read_log
from fixtures.watch.record import Gain, _constant, _net  # the models the rule fixtures were recorded with
from fixtures.watch.zero_init import TinyGPT, lora_net
from tests.conftest import ROOT, line_of

HERE = "tests/test_verdicts.py"


def _run(model, steps, *, log=None, every=1, loss_factor=1.0, scaler=None, autocast=False, bad_step=None,
         lr=0.01, dtype=None):
    """A real training run on the CPU, watched; returns the Monitor."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    own = next(model.parameters()).dtype
    with ampaudit.watch(model, optimizer=opt, scaler=scaler, log=log, every=every, dtype=dtype) as mon:
        for step in range(steps):
            x = torch.ones(3, 4, dtype=own)
            if step == bad_step:
                x[0, 0] = float("inf")
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                loss = model(x).float().pow(2).mean() * loss_factor
            opt.zero_grad()
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    return mon


WATCH_LINE = line_of(ROOT / HERE, "dtype=dtype) as " + "mon:")  # the watch call: where the findings point


def _messages(mon, code=None):
    return [(f["rule"], f["module"], f["message"]) for f in mon.summary()["findings"]
            if code is None or f["rule"] == code]


def test_a_tiny_loss_without_a_scaler_underflows_and_names_the_layers_and_steps():
    mon = _run(_net(nn.ReLU()).half(), 4, loss_factor=1e-7)
    summary = mon.summary()
    assert summary["params"]["0.weight"]["zero"] == 4 * 32  # every gradient is exactly zero in fp16
    found = summary["findings"]
    assert [(f["rule"], f["severity"], f["module"], f["file"], f["line"]) for f in found] == [
        ("AMP601", "warning", "0", HERE, WATCH_LINE), ("AMP601", "warning", "2", HERE, WATCH_LINE)]
    assert found[0]["message"] == (
        "100% of `0`'s parameter gradients (0.bias, 0.weight) are zero or below float16's smallest normal with "
        "no loss scale, in 4 logged steps from 0 to 3: those updates are lost")
    assert found[0]["fix"].startswith("scale the loss with torch.amp.GradScaler")


def test_underflow_is_judged_at_the_loss_scale():
    # The same loss with a GradScaler: the gradients watch records are unscaled (after
    # scaler.step), all below float16's smallest normal - but not at the scale the backward ran with.
    mon = _run(_net(nn.ReLU()), 4, loss_factor=1e-7, autocast=True, scaler=torch.amp.GradScaler("cpu", 2.0**24))
    weight = mon.summary()["params"]["2.weight"]
    assert weight["underflow"] == weight["numel"] - weight["zero"] > 0
    assert _messages(mon) == []
    # At a scale of 1 they are lost, and the fix is a higher init_scale.
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000)
    mon = _run(_net(nn.ReLU()), 4, loss_factor=1e-7, autocast=True, scaler=scaler)
    found = [f for f in mon.summary()["findings"] if f["rule"] == "AMP601"]
    assert [f["module"] for f in found] == ["0", "2"]
    assert "at the loss scale, in 4 logged steps from 0 to 3" in found[0]["message"]
    assert found[0]["fix"].startswith("raise the GradScaler's init_scale")


def test_exact_zeros_beside_healthy_gradients_are_not_underflow():
    # A ReLU with most units dead: most of layer 0's gradients are exact zeros, none is small.
    model = _net(nn.ReLU())
    with torch.no_grad():
        model[0].bias[:6] = -100.0  # 6 of 8 units never fire
    mon = _run(model, 3)
    weight = mon.summary()["params"]["0.weight"]
    assert weight["zero"] >= 0.75 * weight["numel"]
    assert _messages(mon, "AMP601") == []


def test_headroom_names_the_layer_within_2x_of_the_max():
    mon = _run(_constant(_net(Gain(1e5)), 0.1, 0.05), 3, lr=0.0)  # outputs 0.4 * 1e5 = 40000
    assert _messages(mon) == [("AMP602", "1", "`1`'s output reached 40000 in 3 logged steps from 0 to 2: within "
                                               "2x of float16's max 65504, a step away from overflowing to inf")]
    assert _messages(_run(_constant(_net(Gain(7e4)), 0.1, 0.05), 3, lr=0.0)) == []  # 28000: below 32752
    # bfloat16 has fp32's range: 40000 is nothing
    assert _messages(_run(_constant(_net(Gain(1e5)), 0.1, 0.05), 3, lr=0.0, dtype="bfloat16")) == []


# -- words that mislead (issue 28 item 12): each message below was wrong before -------------------------

def test_a_bfloat16_run_s_exact_zero_gradients_are_not_underflow():
    """A zero-initialised output projection (nanochat, modded-nanogpt) makes the gradients of
    the layers before it exactly zero on the first step. In a bfloat16 run (fp32's range) no
    gradient is flushed to zero: AMP601 said "100% ... are zero or below bfloat16's smallest
    normal ...: those updates are lost"."""
    model = _net(nn.ReLU())
    nn.init.zeros_(model[2].weight)
    mon = _run(model.bfloat16(), 1)
    assert mon.summary()["params"]["0.weight"]["zero"] == 32  # all zero, none underflowed
    assert _messages(mon, "AMP601") == []
    # nor in float16, where layer 2's gradients are healthy: a flush leaves small values behind
    half = _net(nn.ReLU())
    nn.init.zeros_(half[2].weight)
    mon = _run(half.half(), 1)
    assert mon.summary()["params"]["0.weight"]["zero"] == 32
    assert _messages(mon, "AMP601") == []


def _gpt_run(model, steps, *, log=None, scaler=None, loss_factor=1.0):
    """nanochat's loop in miniature: fp16 matmuls, fp32 master weights, a GradScaler."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    scaler = scaler or torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(0)
    with ampaudit.watch(model, optimizer=opt, scaler=scaler, log=log) as mon:
        for _ in range(steps):
            idx, targets = torch.randint(0, 32, (2, 2, 8), generator=gen)
            scaler.scale(model(idx, targets) * loss_factor).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return mon


@pytest.mark.parametrize("logged", [False, True])
def test_zero_initialised_projections_block_gradients_they_do_not_underflow(tmp_path, logged):
    """nanochat / modded-nanogpt zero their output projections (and a head): on the first steps
    the layers before them get gradients that are exactly zero, in fp16 as in fp32. AMP601 said
    "100% of `h.0.attn.c_q`'s parameter gradients ... are zero or below float16's smallest normal
    at the loss scale: those updates are lost" for each c_q, c_k, c_v and c_fc (and, with the
    head zero, every module but the head). The same with a log (the host's conditions) and
    without (the device's)."""
    log = tmp_path / "run.jsonl" if logged else None
    mon = _gpt_run(TinyGPT(), 2, log=log)
    params = mon.summary()["params"]
    assert params["h.0.attn.c_q.weight"]["zero"] == params["h.0.attn.c_q.weight"]["numel"] // 2 == 256  # step 0
    assert params["h.0.mlp.c_fc.weight"]["zero"] >= 1024  # step 0's, and dead units' of step 1
    assert _messages(mon, "AMP601") == []
    head = _gpt_run(TinyGPT(zero_head=True), 2, log=log)
    assert head.summary()["params"]["h.0.mlp.c_proj.weight"]["zero"] == 1024  # blocked in step 0 too
    assert _messages(head, "AMP601") == []
    # the same model at a loss scale of 1 with a small loss underflows, the blocked layers included
    low = _gpt_run(TinyGPT(), 2, log=log, loss_factor=1e-4,
                   scaler=torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000))
    assert sorted({m for _, m, _ in _messages(low, "AMP601")}) == [
        "h.0.attn.c_k", "h.0.attn.c_proj", "h.0.attn.c_q", "h.0.attn.c_v", "h.0.mlp.c_fc", "h.0.mlp.c_proj",
        "lm_head", "wte"]


def test_lora_a_while_b_is_zero_is_not_underflow():
    """peft's LoRA: B starts at zero, so A's gradient is exactly zero on the first step (fp16
    autocast, a GradScaler); AMP601 named both lora_A."""
    model = lora_net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(0)
    with ampaudit.watch(model, optimizer=opt, scaler=scaler) as mon:
        for _ in range(2):
            x = torch.randn(4, 8, generator=gen)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), torch.arange(4))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    params = mon.summary()["params"]
    assert params["0.lora_A.weight"]["zero"] == params["0.lora_A.weight"]["numel"] // 2 == 32  # step 0: all
    assert set(params) == {"0.lora_A.weight", "0.lora_B.weight", "2.lora_A.weight", "2.lora_B.weight"}
    assert _messages(mon, "AMP601") == []


def test_headroom_past_the_max_says_how_far_past():
    """An fp32 run audited for float16: 1.1e6 is 17x past the max, not "within 2x"."""
    mon = _run(_constant(_net(Gain(2.75e6)), 0.1, 0.05), 1, lr=0.0)  # 0.4 * 2.75e6 = 1.1e6
    assert ("AMP602", "1", "`1`'s output reached 1.1e+06 at step 0: 16.8x past float16's max 65504: it overflows "
                           "to inf in float16") in _messages(mon)


def test_underflow_in_an_fp32_run_is_not_lost_updates():
    """An fp32 run (no autocast, no .half()) audited for float16 by default: nothing was lost."""
    mon = _run(_net(nn.ReLU()), 2, loss_factor=1e-7)
    assert mon.summary()["dtype_source"] == "default"
    messages = [m for _, _, m in _messages(mon, "AMP601")]
    wider = "in float16 those updates would be lost (this run computes in a wider dtype)"
    assert messages and all(m.endswith(wider) for m in messages)
    # nor in a float64 one (pytorch/examples' time_sequence_prediction): it said "computes in float32"
    double = [m for _, _, m in _messages(_run(_net(nn.ReLU()).double(), 2, loss_factor=1e-7), "AMP601")]
    assert double and all(m.endswith(wider) for m in double)
    # a float16 model: they are lost
    half = [m for _, _, m in _messages(_run(_net(nn.ReLU()).half(), 2, loss_factor=1e-7), "AMP601")]
    assert half and all(m.endswith(": those updates are lost") for m in half)


def test_underflow_after_skipped_steps_does_not_say_raise_init_scale():
    """A scale that overflow holds low (here: a tiny init scale that skips, with tiny gradients
    beside an inf every other step): raising init_scale is not the fix, as AMP604 says."""
    opt_model = _net(nn.ReLU())
    mon = _run(opt_model, 4, loss_factor=1e-7, autocast=True, bad_step=1,
               scaler=torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000))
    found = [f for f in mon.summary()["findings"] if f["rule"] == "AMP601"]
    assert found and all(f["fix"].startswith("the GradScaler skipped steps, so overflow keeps the scale low")
                         for f in found)


def test_amp605_is_led_by_where_the_nan_was_born_not_the_enclosing_model():
    """The NaN of step 2 was born in the model's first layer (its forward, from the batch): the
    group lists the model itself, which only encloses it, last."""
    mon = _run(_net(nn.ReLU()), 5, bad_step=2)
    [found] = mon.summary()["findings"]
    assert found["module"] == "0" and found["message"].startswith("`0` (forward)")
    assert found["message"].endswith("also non-finite in those steps: 1 (forward), 2 (forward), 0 (backward), "
                                     "1 (backward) and 3 more")


def test_an_init_scale_of_2_40_skips_steps_in_a_row():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    mon = _run(_net(nn.ReLU()), 24, autocast=True, scaler=scaler)
    summary = mon.summary()
    assert summary["scaler"]["skipped_steps"] == list(range(22))
    [found] = summary["findings"]
    assert (found["rule"], found["severity"], found["module"]) == ("AMP604", "error", "2")
    assert found["message"] == (
        "22 steps in a row skipped by the loss scaler (steps 0-21, scale 2**40 down to 2**19): no update was "
        "applied in them; non-finite gradients most often in `2.bias`")
    assert found["fix"] == "lower the GradScaler's init_scale: the first steps only halve it"
    # the default init scale: no skip at all
    assert _messages(_run(_net(nn.ReLU()), 24, autocast=True, scaler=torch.amp.GradScaler("cpu"))) == []


def test_a_collapsed_loss_scale():
    # gradients beyond 65504 at any scale tried: the scaler halves its way from 4 to 2**-8
    mon = _run(_net(nn.ReLU()), 12, loss_factor=1e6, autocast=True, scaler=torch.amp.GradScaler("cpu", 4.0))
    history = mon.summary()["scaler"]["history"]
    below = [step for step, scale in history if scale < 1]
    [found] = _messages(mon, "AMP603")
    assert below == list(range(3, 12))
    assert found == ("AMP603", "2", "the loss scale collapsed to 0.00390625 at step 11 (below 1; in 9 logged steps "
                                    "from 3 to 11): the gradients overflow even at that scale; non-finite gradients "
                                    "most often in `2.bias`")


class _SqrtHead(nn.Module):
    """A head whose own body, once, takes a square root where its Linear's output is 0: the
    forward finite, the gradient NaN from the head's backward on (DETR's box MLP shaped)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bad = nn.Linear(4, 4), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return (h - h[:, :1]).abs().sqrt() if self.bad else h


def test_a_gradient_born_in_a_modules_body_is_reported_under_it_not_under_the_first_layer():
    """AMP605 groups the modules non-finite over the same steps under the one that went first.
    A NaN born in the backward of a module's own body (``1``: its output gradient finite, its
    input's not) leaves that module out of the group, which was then led by the name that
    sorts first: `0`, the model's first layer - the last the gradient reaches. Its own Linear,
    the first, leads now."""
    torch.manual_seed(0)
    head = _SqrtHead()
    model = nn.Sequential(nn.Linear(4, 4), head)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampaudit.watch(model, optimizer=opt) as mon:
        for step in range(5):
            head.bad = step == 1
            loss = model(torch.randn(3, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    summary = mon.summary()
    first = summary["first_nonfinite"]
    assert (first["module"], first["phase"], first["step"]) == ("1", "backward", 1)
    # the NaN weights that step leaves: every forward from step 2 on, a group of its own
    assert [(f["rule"], f["module"], f["message"]) for f in summary["findings"]] == [
        ("AMP605", "1.fc", "`1.fc` (backward) is non-finite in every logged step from 1 to 4 (4 steps); also "
                           "non-finite in those steps: 0 (backward)"),
        ("AMP605", "0", "`0` (forward) is non-finite in every logged step from 2 to 4 (3 steps); also non-finite "
                        "in those steps: 1.fc (forward), (model) (forward), 1 (forward), (model) (backward) and 1 "
                        "more")]


def test_one_bad_batch_without_a_scaler_leaves_the_model_non_finite_for_good():
    mon = _run(_net(nn.ReLU()), 6, bad_step=2)
    [found] = mon.summary()["findings"]
    assert (found["rule"], found["severity"], found["module"]) == ("AMP605", "error", "0")
    assert found["message"] == (
        "`0` (forward) is non-finite in every logged step from 2 to 5 (4 steps); also non-finite in those steps: "
        "1 (forward), 2 (forward), 0 (backward), 1 (backward) and 3 more")  # the model, which encloses them, last
    # with a GradScaler the step is skipped, the weights stay finite: one bad step, no verdict
    mon = _run(_net(nn.ReLU()), 6, bad_step=2, autocast=True, scaler=torch.amp.GradScaler("cpu"))
    assert mon.summary()["first_nonfinite"]["step"] == 2
    assert _messages(mon) == []


RUNS = {
    "underflow": dict(model=lambda: _net(nn.ReLU()).half(), steps=5, loss_factor=1e-7),
    "headroom": dict(model=lambda: _constant(_net(Gain(1e5)), 0.1, 0.05), steps=4, lr=0.0),
    "skips": dict(model=lambda: _net(nn.ReLU()), steps=24, autocast=True,
                  scaler=lambda: torch.amp.GradScaler("cpu", 2.0**40)),
    "collapse": dict(model=lambda: _net(nn.ReLU()), steps=12, loss_factor=1e6, autocast=True,
                     scaler=lambda: torch.amp.GradScaler("cpu", 4.0)),
    "nonfinite": dict(model=lambda: _net(nn.ReLU()), steps=8, bad_step=2),
    # scales 3, 6, 12: not powers of 2
    "scaled-underflow": dict(model=lambda: _net(nn.ReLU()), steps=5, loss_factor=1e-7, autocast=True,
                             scaler=lambda: torch.amp.GradScaler("cpu", 3.0, growth_interval=2)),
}


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("case", sorted(RUNS))
def test_with_and_without_a_log_the_findings_are_the_same(tmp_path, case, every):
    # A watch (with a log or without) tracks the conditions on the device; the report reads
    # the log's per-step statistics and tracks them on the host: the same findings.
    def run(log):
        spec = dict(RUNS[case])
        model, scaler = spec.pop("model")(), spec.pop("scaler", None)
        return _run(model, log=log, every=every, scaler=scaler() if scaler else None, **spec)

    log = tmp_path / "run.jsonl"
    live, logged = run(None), run(log)
    assert live._conditions.read() is not None and logged._conditions.read() is not None
    without = live.summary()["findings"]
    assert without, case
    assert without == logged.summary()["findings"] == read_log(log).summary()["findings"]


def test_the_rows_on_the_device_update_as_on_the_host():
    rng = random.Random(0)
    n, steps = 6, [0, 1, 2, 4, 5, 6, 7, 9, 10, 11]
    host = [verdicts.new_row() for _ in range(n)]
    device = torch.tensor(host, dtype=torch.float64)
    prev = -1
    for step in steps:
        cond = [rng.random() < 0.6 for _ in range(n)]
        a = [float(rng.randint(0, 50)) for _ in range(n)]
        b = [float(rng.randint(50, 99)) for _ in range(n)]
        for row, c, x, y in zip(host, cond, a, b, strict=True):
            verdicts.update_row(row, step, prev, c, x, y)
        device = conditions.update_rows(device, step, prev, torch.tensor(cond), torch.tensor(a, dtype=torch.float64),
                                        torch.tensor(b, dtype=torch.float64))
        prev = step
    assert device.tolist() == host


def test_the_c_loop_updates_the_rows_as_the_torch_ops():
    # conditions.update_steps on the CPU is one C loop over K steps: the same float64 rows as
    # K update_rows, NaN values (a NaN absmax) and repeated runs included
    if not cpu_kernel.available():
        pytest.skip(cpu_kernel.status())
    gen = torch.Generator().manual_seed(0)
    n, steps = 7, [0, 1, 2, 4, 5, 6, 7, 9, 10, 11, 12, 20]
    start = torch.tensor([verdicts.new_row() for _ in range(n)], dtype=torch.float64)
    cond = torch.rand(len(steps), n, generator=gen) < 0.6
    value = torch.randint(0, 50, (len(steps), n), generator=gen).double()
    value[3, 2] = value[8, 5] = float("nan")
    total = torch.randint(50, 99, (len(steps), n), generator=gen).double()
    expected, prev = start, -1
    for k, step in enumerate(steps):
        expected = conditions.update_rows(expected, step, prev, cond[k], value[k], total[k])
        prev = step
    got = cpu_kernel.update_rows(start, steps, -1, cond, value, total)
    assert torch.equal(got.isnan(), expected.isnan())
    assert got.nan_to_num(-7.0).tolist() == expected.nan_to_num(-7.0).tolist()
    assert start.tolist() == [verdicts.new_row() for _ in range(n)]


@pytest.mark.parametrize("kernel", [True, False])  # the C loops, or the torch ops where no compiler is
@pytest.mark.parametrize("case", ["skips", "scaled-underflow", "collapse", "nonfinite"])
def test_judging_steps_in_batches_changes_nothing(monkeypatch, case, kernel):
    # Conditions and totals of up to BATCH logged steps are judged together (per-row loss
    # scales, batches cut where the keys change): the summary is the one of a step at a time.
    if not kernel:
        monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    def run():
        spec = dict(RUNS[case])
        model, scaler = spec.pop("model")(), spec.pop("scaler", None)
        summary = _run(model, scaler=scaler() if scaler else None, **spec).summary()
        # as text: a NaN norm (a step that went non-finite) equals itself
        return json.dumps({k: summary[k] for k in ("findings", "layers", "params", "steps", "first_nonfinite")},
                          sort_keys=True, default=str)

    batched = run()
    monkeypatch.setattr(conditions, "BATCH", 1)
    monkeypatch.setattr(reducer, "TOTALS_BATCH", 1)
    assert run() == batched
    monkeypatch.setattr(conditions, "BATCH", 5)  # partial batches, flushed at summary()
    monkeypatch.setattr(reducer, "TOTALS_BATCH", 3)
    assert run() == batched


def _stats_row(counts: dict[int, int], absmax: float) -> list[float]:
    """A Stats row (layout.FIELDS, then the exponent histogram) with ``counts`` per biased exponent."""
    row = [0.0] * stats.WIDTH
    row[LAYOUT.field["numel"]] = float(sum(counts.values()))
    row[LAYOUT.field["absmax"]] = absmax
    for exponent, n in counts.items():
        row[LAYOUT.hist + exponent] = float(n)
    return row


def test_a_batch_judges_each_step_at_its_own_loss_scale():
    # Gradients around float16's smallest normal (2^-14: biased exponent 113): at scale 1 most
    # underflow, at 2^6 half, at 2^12 none - AMP601's condition holds on some steps only,
    # and only each step's own scale says which. Batched (the default) or a step at a time,
    # the same state rows; and a batch cut where the keys change.
    limits = LowDtype.parse(torch.float16)
    keys = [("fc", "forward"), ("fc", "backward")]
    params = ["fc.weight", "fc.bias"]
    grads = [_stats_row({105: 40, 110: 30, 116: 30}, 2.0**-10), _stats_row({100: 5, 108: 5}, 2.0**-18)]
    layer = _stats_row({120: 10, 126: 5}, 1.5)
    scales = [1.0, 2.0**6, 2.0**12, 2.0**6, 1.0, 2.0**12, 2.0**3, 1.0]
    results = []
    for batch in (1, 3, 16):
        device = conditions.DeviceConditions(batch=batch)
        for step, scale in enumerate(scales):
            step_keys = keys if step != 5 else keys[:1]  # a step without the backward row: another layout
            rows = [layer] * len(step_keys) + grads
            flat = torch.tensor([x for row in rows for x in row], dtype=torch.float64)
            device.add(step, flat, step_keys, params, torch.tensor(scale), limits)
        results.append(device.read())
    assert results[0] == results[1] == results[2]
    # at scale 1, 80 of fc's 110 gradient elements are lost (>= min_share 0.5); at 2^3 50, 2^6 45,
    # 2^12 5: the condition holds at steps 0, 4 and 7
    row = results[0]["rows"][("AMP601", "fc", "grad")]
    assert (row[rule_api.COUNT], row[rule_api.FIRST], row[rule_api.LAST], row[rule_api.SUM_VALUE]) == (3, 0, 7, 240)


def _record(step, *, scale=None, skipped=False, layers=None):
    return {"step": step, "layers": layers or {}, "params": {}, "scale": scale, "skipped": skipped,
            "nonfinite_params": ["w"] if skipped else [], "first_nonfinite": None}


def test_state_stays_constant_however_long_the_run():
    builder = SummaryBuilder("float16", source={"file": "train.py", "line": 3})
    nan = {"numel": 4, "nan": 4, "inf": 0, "overflow": 0, "underflow": 0, "zero": 0, "absmax": 0.0, "hist": []}
    for step in range(3000):
        builder.add(_record(step, scale=2.0**16 if step % 2 else 2.0**15, skipped=step % 2 == 0,
                            layers={"fc": {"forward": nan}}))
    v = builder.verdicts
    assert len(v.rows) == 2 and len(v.nonfinite) == 1 and len(v.units["AMP604"].best) == 6
    codes = [f.rule for f in builder.findings()]
    assert codes == ["AMP605"]  # never 10 skips in a row; fc always NaN
    assert builder.findings()[0].message.startswith("`fc` (forward) is non-finite in every logged step from 0 to "
                                                    "2999 (3000 steps)")


def test_a_run_of_skips_and_a_drop_from_the_scale_that_trained():
    builder = SummaryBuilder("float16", source={})
    scales = [2.0**16] * 3 + [2.0**15 / 2**k for k in range(18)]  # applied, then skipped down to 2**-2
    for step, scale in enumerate(scales):
        builder.add(_record(step, scale=scale, skipped=step >= 3))
    found = {f.rule: f for f in builder.findings()}
    assert set(found) == {"AMP603", "AMP604"}
    assert found["AMP603"].message == (  # 2**16 below the scale steps 0-2 trained at, from step 18; below 1 after
        "the loss scale collapsed to 0.25 at step 20 (below 1; in 3 logged steps from 18 to 20): the gradients "
        "overflow even at that scale; non-finite gradients most often in `w`")
    assert found["AMP604"].message.startswith("18 steps in a row skipped by the loss scaler (steps 3-20, scale 2**15 "
                                              "down to 0.25)")
    assert found["AMP604"].fix == "keep the layer whose gradients overflow in fp32, or train in bfloat16"
    builder = SummaryBuilder("float16", source={})
    for step, scale in enumerate(scales[:19]):  # down to 1: not below it, but 2**16 below where it trained
        builder.add(_record(step, scale=scale, skipped=step >= 3))
    assert [f.message for f in builder.findings() if f.rule == "AMP603"] == [
        "the loss scale collapsed to 1 at step 18 (2**16x below 2**16, the scale step 0 was applied with): the "
        "gradients overflow even at that scale; non-finite gradients most often in `w`"]
    assert (found["AMP603"].file, found["AMP603"].line) == ("<watch>", 0)


def test_print_ends_with_the_findings_in_checks_format():
    mon = _run(_constant(_net(Gain(1e5)), 0.1, 0.05), 2, lr=0.0)
    out = io.StringIO()
    mon.print(file=out)
    text = out.getvalue()
    assert f"{HERE}:{WATCH_LINE} AMP602 [warning] `1`'s output reached 40000" in text.replace("\n", " ")
    assert text.rstrip().endswith("Found 0 errors, 1 warnings, 0 infos. `ampaudit explain AMP602` tells more about "
                                  "a rule.")
    assert "  fix: keep this module in fp32" in text


def test_report_ends_with_the_findings_and_exits_by_their_severity(cli):
    fixtures = ROOT / "fixtures" / "watch"
    error, warning, clean = (fixtures / f"{name}.jsonl" for name in ("AMP605_invalid", "AMP601_invalid",
                                                                    "AMP601_valid"))
    result = cli("report", error)
    assert result.code == 1
    assert "fixtures/watch/record.py:42 AMP605 [error] `0` (forward) is non-finite" in result.out
    assert result.out.rstrip().endswith("`ampaudit explain AMP605` tells more about a rule.")
    assert cli("report", error, "--fail-on", "never").code == 0
    assert cli("report", warning).code == 0  # warnings: exit 1 only with --fail-on warning
    assert cli("report", warning, "--fail-on", "warning").code == 1
    result = cli("report", clean, "--fail-on", "info")
    assert result.code == 0 and result.out.rstrip().endswith("No findings.")
    data = cli("report", warning, "--format", "json").json()
    assert [f["rule"] for f in data["findings"]] == ["AMP601", "AMP601"]
    sarif = cli("report", error, "--format", "sarif").json()
    [res] = sarif["runs"][0]["results"]
    assert res["ruleId"] == "AMP605" and res["locations"][0]["logicalLocations"][0]["fullyQualifiedName"] == "0"
    github = cli("report", error, "--format", "github").out
    assert github.startswith("::error file=fixtures/watch/record.py,line=42,title=ampaudit AMP605::`0` (forward)")


def test_a_log_that_does_not_say_where_it_ran_points_at_itself(tmp_path):
    lines = (ROOT / "fixtures" / "watch" / "AMP605_invalid.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    del header["source"]
    log = tmp_path / "old.jsonl"
    log.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    [found] = read_log(log).summary()["findings"]
    assert (found["file"], found["line"]) == (str(log), 0)


def test_run_points_the_findings_at_the_script(tmp_path, cli):
    script = tmp_path / "train.py"
    script.write_text("import torch\nfrom torch import nn\n\ntorch.manual_seed(0)\n"
                      "model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).half()\n"
                      "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
                      "for _ in range(2):\n"
                      "    loss = model(torch.ones(3, 4, dtype=torch.float16)).float().pow(2).mean() * 1e-7\n"
                      "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n")
    log = tmp_path / "run.jsonl"
    result = cli("run", "--log", log, script)
    assert result.code == 0
    assert f"{script} AMP601 [warning] 100% of `0`'s parameter gradients" in " ".join(result.err.split())
    assert [(f["file"], f["line"]) for f in read_log(log).summary()["findings"]] == [(str(script), 0)] * 2


def test_each_runtime_code_is_one_registered_unit():
    units = REGISTRY.load()
    assert set(units) == {code for code in rulebook() if code.startswith(("AMP6", "AMP75"))} \
        == set(verdicts.RUNTIME_RULES)
    assert len(set(units.values())) == len(units) and all(cls.code == code for code, cls in units.items())
    with pytest.raises(RuntimeError, match="AMP601 registered twice"):
        runtime_rule("AMP601")(type("Again", (LayerRule,), {}))


def test_no_rule_is_written_outside_its_unit():
    # The engines know no rule: a code or a threshold named there would be a second copy of it.
    params = {name for code in verdicts.RUNTIME_RULES for name in rulebook()[code].params}
    for name in ("verdicts.py", "conditions.py", "rule_api.py", "summary.py", "monitor.py"):
        text = (ROOT / "ampaudit" / "watch" / name).read_text()
        assert re.findall(r"AMP6\d\d|AMP75\d", text) == [], name
        assert [p for p in params if f'"{p}"' in text or f"'{p}'" in text] == [], name


def _toy_rulebook(monkeypatch, code, message, **params):
    monkeypatch.setitem(rulebook(), code, RuleInfo(code, "toy", Severity.INFO, message, "", "", "", "",
                                                   params=params, hints={"fix": "a toy's fix"}))


def test_a_new_rule_is_one_unit_and_finds_the_same_from_a_log_and_on_the_device(monkeypatch, tmp_path):
    # A rule added in one place - its words in the rulebook, its condition written once - fires
    # from the log (Python numbers) as on the device (tensor columns), with no other edit.
    REGISTRY.load()
    monkeypatch.setattr(REGISTRY, "by_code", dict(REGISTRY.by_code))  # the toys leave with the test
    _toy_rulebook(monkeypatch, "AMP698", "`{module}` ({phase}): up to {zeros} of it zero {steps}", share=0.25)
    _toy_rulebook(monkeypatch, "AMP699", "`{module}`'s gradients peak at {peak} {steps}", floor=1e-30)

    @runtime_rule("AMP698")
    class MostlyZero(LayerRule):
        phases = ("forward", "backward")

        def condition(self, s, step):
            share = where(s.numel > 0, s.zero / maximum(s.numel, 1), 0.0)
            return Condition((share >= self.params["share"]) & ((s.nan + s.inf) == 0), share, s.numel)

        def report(self, rows, run):
            for (module, phase), row in rows.items():
                if row.count:
                    yield Verdict(row.first, module, self.hints["fix"],
                                  dict(module=module, phase=phase, zeros=f"{row.peak:.3f}", steps=steps_text(row)))

    @runtime_rule("AMP699")
    class GradientPeak(GradientRule):
        def measure(self, s, step):
            return minimum(s.absmax, 1e30), s.numel

        def condition(self, peak, numel, step):
            return (peak > self.params["floor"]) & (numel > 0)

        def report(self, rows, run):
            for (module, _), row in rows.items():
                if row.count >= 2:
                    yield Verdict(row.first, module, None, dict(module=module, peak=f"{row.peak:.4g}",
                                                               steps=steps_text(row)))

    log = tmp_path / "run.jsonl"
    live = _run(_net(nn.ReLU()), 4, bad_step=1)
    logged = _run(_net(nn.ReLU()), 4, bad_step=1, log=log)
    found = live.summary()["findings"]
    assert found == logged.summary()["findings"] == read_log(log).summary()["findings"]
    toys = [(f["rule"], f["module"]) for f in found if f["rule"] in ("AMP698", "AMP699")]
    assert toys == [("AMP698", "0"), ("AMP698", "1"), ("AMP699", "0")]  # ReLU's zeros: its output, 0's gradient
    toy = next(f for f in found if f["rule"] == "AMP698")
    assert (toy["message"], toy["fix"]) == ("`0` (backward): up to 0.500 of it zero at step 0", "a toy's fix")


def test_the_condition_helpers_are_the_same_on_numbers_and_tensors():
    xs, ys = [0.0, 2.0, -3.0, 5.0], [1.0, 2.0, -4.0, 0.5]
    tx, ty = torch.tensor(xs, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    assert [where(x > y, x, y) for x, y in zip(xs, ys, strict=True)] == where(tx > ty, tx, ty).tolist()
    for fn in (maximum, minimum):
        assert [fn(x, y) for x, y in zip(xs, ys, strict=True)] == fn(tx, ty).tolist()
        assert [fn(x, 1.0) for x in xs] == fn(tx, 1.0).tolist() == fn(1.0, tx).tolist()


@pytest.mark.parametrize("logged", [False, True])
def test_a_step_the_scaler_skips_is_no_underflow(tmp_path, logged):
    """One infinite gradient (DETR's fp16 run: an attention bias at the first scale) makes
    ``clip_grad_norm_``'s total norm inf, and it multiplies every other gradient by 0; the
    GradScaler skips the step. AMP601 counted those zeros - "100% of `0`'s parameter gradients
    ... at step 2: those updates are lost" for every layer, of a step never applied. A skipped
    step's gradients now say nothing of underflow, on the device and from a log alike."""
    torch.manual_seed(0)
    model = _net(nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    log = tmp_path / "watch.jsonl" if logged else None
    with ampaudit.watch(model, optimizer=opt, scaler=scaler, dtype="float16", log=log) as mon:
        for step in range(4):
            loss = model(torch.randn(3, 4)).pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            if step == 2:
                model[2].weight.grad[0, 0] = float("inf")
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    summary = mon.summary()
    assert summary["scaler"]["skipped_steps"] == [2]
    assert summary["findings"] == []


class _ThreeStages(nn.Module):
    """Pytorch-UNet's shape in three Linears: they run ``inc``, ``down``, ``up`` - an order that
    sorts otherwise by name."""

    def __init__(self) -> None:
        super().__init__()
        self.inc, self.down, self.up = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(torch.relu(self.down(torch.relu(self.inc(x)))))


@pytest.mark.parametrize("log", [False, True])
def test_a_later_groups_lead_is_the_module_its_first_step_went_non_finite_in(tmp_path, log):
    """An inf written into the last stage's weight: step 0's NaN gradients, clipped, leave every
    weight NaN, and from step 1 on the model's first stage (``inc``) is the first non-finite.
    That group's lead was the member whose name sorts first (``down``, which only passes
    ``inc``'s NaN on); it is now the module that step's own first non-finite names."""
    torch.manual_seed(0)
    model = _ThreeStages()
    with torch.no_grad():
        model.up.weight[0, 0] = float("inf")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "run.jsonl"
    with ampaudit.watch(model, optimizer=opt, log=path if log else None) as mon:
        for _ in range(4):
            loss = model(torch.randn(3, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    summary = mon.summary()
    assert (summary["first_nonfinite"]["module"], summary["first_nonfinite"]["step"]) == ("up", 0)
    leads = [(f["module"], f["message"].split(";")[0]) for f in summary["findings"] if f["rule"] == "AMP605"]
    assert leads == [("up", "`up` (forward) is non-finite in every logged step from 0 to 3 (4 steps)"),
                     ("inc", "`inc` (forward) is non-finite in every logged step from 1 to 3 (3 steps)")]
    if log:  # the log's report says the same
        assert [f.to_dict() for f in read_log(path).findings()] == summary["findings"]


def test_each_steps_first_non_finite_is_kept_where_it_changes_and_no_more_than_firsts_kept():
    v = verdicts.Verdicts()
    for step, module in enumerate(["a", "a", None, "b", "b"]):
        v._add_first(step, {"module": module, "phase": "forward"} if module else None)
    assert v.firsts == [(0, "a", "forward"), (2, None, None), (3, "b", "forward")]
    run = rule_api.Run(LowDtype.parse("float16"), False, None, {}, None, firsts=tuple(v.firsts))
    assert [run.first_at(s) for s in (-1, 0, 1, 2, 3, 9)] == [None, ("a", "forward"), ("a", "forward"), None,
                                                              ("b", "forward"), ("b", "forward")]
    flips = verdicts.Verdicts()
    for step in range(3 * rule_api.FIRSTS_KEPT):  # a run whose first non-finite flips every step
        flips._add_first(step, {"module": "ab"[step % 2], "phase": "forward"})
    assert len(flips.firsts) == rule_api.FIRSTS_KEPT and flips.firsts[-1][1] is None  # unknown from there on
