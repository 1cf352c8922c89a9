"""watch(..., fp8=True): float8 statistics per Linear operand and step, compared with a direct
torch computation on the same tensors (torchao's scale formula, torch's own float8 casts), and
the verdicts AMP750 (an amax spike past the delayed recipe's history) and AMP751 (grad_output
flushed to zero in e5m2), at the exact step and share."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import ampaudit
from ampaudit.watch.summary import read_log
from tests.conftest import host_syncs

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's amax_to_scale, written out: max / amax in float64, as float32."""
    return (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()


def _flushed(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> int:
    """Nonzero elements torch's float8 cast of x * scale rounds to zero."""
    y = x.detach().float() * scale
    return int(((y.to(dtype).float() == 0) & (x != 0)).sum())


def _saturated(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> int:
    """Elements the cast takes past the max: inf in e5m2; e4m3fn (torch's cast saturates by
    itself) beyond the max plus half an ulp, 464."""
    y = x.detach().float().abs() * scale
    if dtype == E5M2:
        return int(torch.isinf(y.to(dtype).float()).sum())
    return int((y > 464).sum())


def _train(model, batches, *, loss_weight=None, history=16, log=None, lr=0.0):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    seen = []  # per step: {module: (input, grad_output)}
    with ampaudit.watch(model, optimizer=opt, fp8=True, fp8_history=history, log=log) as mon:
        for x in batches:
            out = model(x)
            out.retain_grad()
            loss = (out * loss_weight).sum() if loss_weight is not None else out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            seen.append((x.clone(), out.grad.clone()))
            opt.step()
    return mon, seen


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()[1:] if '"step"' in line]


def test_a_planted_input_spike_is_the_amax_spike_verdict_at_its_step_with_the_counts_torch_gives(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    batches = [torch.randn(6, 8) for _ in range(6)]
    batches[3] = batches[3] * 50  # the spike, at step 3
    # a loss whose output gradient is ones every step: only the input spikes
    mon, seen = _train(model, batches, history=4, log=tmp_path / "w.jsonl", loss_weight=torch.ones(6, 4))
    found = [f for f in mon.summary()["findings"] if f["rule"] == "AMP750"]
    assert [(f["module"], f["message"].split(" amax")[0]) for f in found] == [("(model)", "`(model)`'s input")]
    ratio = batches[3].abs().max() / max(b.abs().max() for b in batches[:3])
    share = _saturated(batches[3], _scale(max(b.abs().max() for b in batches[:3]), E4M3), E4M3) / batches[3].numel()
    assert found[0]["message"] == (
        f"`(model)`'s input amax jumped {ratio:.3g}x past its amax history's largest at step 3: a delayed-scaling "
        f"float8 recipe would saturate {100 * share:.1f}% of its elements there (e4m3: clamped to its max)")
    records = _records(tmp_path / "w.jsonl")
    for step, (record, (x, _)) in enumerate(zip(records, seen, strict=True)):
        row = record["fp8"]["(model)"]["input"]
        amax = x.abs().max()
        history = [b.abs().max() for b in batches[max(0, step - 4):step]]
        delayed = _scale(max(history), E4M3) if history else _scale(amax, E4M3)
        assert row["amax"] == amax.item() and row["format"] == "e4m3" and row["numel"] == 48
        assert row["scale"] == _scale(amax, E4M3).item() and row["delayed_scale"] == delayed.item()
        assert row["history_amax"] == (max(history).item() if history else 0.0)
        assert row["jump"] == pytest.approx((amax / history[-1]).item() if history else 0.0, rel=1e-6)
        assert "saturated" not in row and _saturated(x, _scale(amax, E4M3), E4M3) == 0  # tensorwise: never
        assert row["underflow"] == _flushed(x, _scale(amax, E4M3), E4M3)
        assert row["delayed_saturated"] == _saturated(x, delayed, E4M3)
        assert row["delayed_underflow"] == _flushed(x, delayed, E4M3)
    assert records[3]["fp8"]["(model)"]["input"]["delayed_saturated"] > 0
    # after the spike the history holds it: the delayed scale is 50x too small, nothing saturates
    assert records[4]["fp8"]["(model)"]["input"]["delayed_saturated"] == 0
    weight = records[5]["fp8"]["(model)"]["weight"]  # lr 0: the same weight every step, no jump
    assert (weight["amax"], weight["jump"], weight["delayed_saturated"]) == (model.weight.abs().max().item(), 1.0, 0)


def test_grad_output_far_below_e5m2s_range_is_the_underflow_verdict_with_the_exact_share():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    weight = torch.full((6, 4), 1e-12)  # 2**40 below the one large entry: past e5m2's 2**32
    weight[0, 0] = 1.0
    weight[1, 1] = 0.0  # a zero is not an underflow
    mon, seen = _train(model, [torch.randn(6, 8) for _ in range(4)], loss_weight=weight)
    grad = seen[0][1]
    assert torch.equal(grad, weight)
    lost = _flushed(grad, _scale(grad.abs().max(), E5M2), E5M2)
    assert lost == 22  # 24 elements: the large one and the zero are not lost
    [found] = [f for f in mon.summary()["findings"] if f["rule"] == "AMP751"]
    assert found["module"] == "(model)"
    assert found["message"] == ("`(model)`'s output gradient loses 91.7% of its elements (nonzero values rounded to "
                                "zero) in e5m2 even at its own tensorwise scale, in 4 logged steps from 0 to 3 (4 in "
                                "a row from step 0)")  # 22 of 24
    row = mon.summary()["fp8"]["(model)"]["grad_output"]
    assert (row["steps"], row["numel"], row["underflow"], row["format"]) == (4, 96, 88, "e5m2")


def test_two_steps_of_gradient_underflow_are_not_persistent():
    torch.manual_seed(0)
    far = torch.full((6, 4), 1e-12)
    far[0, 0] = 1.0
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with ampaudit.watch(model, optimizer=opt, fp8=True) as mon:
        for step in range(5):  # flushed in steps 0, 1 and 3: never 3 in a row (min_steps)
            weight = far if step in (0, 1, 3) else torch.ones(6, 4)
            (model(torch.randn(6, 8)) * weight).sum().backward()
            opt.step()
    summary = mon.summary()
    assert summary["fp8"]["(model)"]["grad_output"]["underflow"] == 3 * 23
    assert [f["rule"] for f in summary["findings"] if f["rule"].startswith("AMP75")] == []


def test_gradients_within_e5m2s_range_and_steady_inputs_give_no_fp8_verdict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    mon, _ = _train(model, [torch.randn(6, 8) for _ in range(5)], lr=0.01)
    summary = mon.summary()
    assert [f["rule"] for f in summary["findings"]] == []
    assert sorted(summary["fp8"]) == ["0", "2"]
    assert {op for entry in summary["fp8"].values() for op in entry} == {"kind", "input", "weight", "grad_output"}


class _ByKeyword(nn.Module):
    """Calls its Linears as ``fc(input=x)`` (nn.Linear.forward's parameter name) or ``fc(x)``."""

    def __init__(self, keyword: bool):
        super().__init__()
        self.keyword = keyword
        self.fc, self.head = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        call = (lambda m, t: m(input=t)) if self.keyword else (lambda m, t: m(t))
        return call(self.head, torch.relu(call(self.fc, x)))


def test_a_linear_called_with_its_input_by_keyword_has_its_input_row(tmp_path):
    # fc(input=x): a forward hook sees the input in kwargs; the input row was missing
    rows = {}
    for keyword in (False, True):
        torch.manual_seed(0)
        log = tmp_path / f"{keyword}.jsonl"
        _train(_ByKeyword(keyword), [torch.randn(6, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)],
               lr=0.01, log=log)
        rows[keyword] = [r["fp8"] for r in _records(log)]
    assert rows[True] == rows[False]
    operands = {"kind", "input", "weight", "grad_output"}
    assert all(set(step[m]) == operands for step in rows[True] for m in ("fc", "head"))


def test_non_finite_steps_are_not_fp8_underflow_or_amax_spikes(tmp_path):
    # an inf input, then NaN: the tensorwise scale of an inf amax is 0 (NaN of a NaN one), so every
    # element counted as flushed: AMP751 said the gradient "loses 100% of its elements" in e5m2 and
    # AMP750 that the amax "jumped infx" - the run's problem is non-finite values (AMP605)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    batches[2][0, 0] = float("inf")
    batches[3][1, 1] = float("nan")
    log = tmp_path / "run.jsonl"
    mon, _ = _train(model, batches, lr=1e-3, log=log)
    rules = sorted({f["rule"] for f in mon.summary()["findings"]})
    assert "AMP605" in rules and not [r for r in rules if r.startswith("AMP75")], rules
    assert sorted({f["rule"] for f in read_log(log).summary()["findings"]}) == rules


def test_without_fp8_no_fp8_rows_are_recorded():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampaudit.watch(model, optimizer=opt) as mon:
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert mon.fp8 is None and "fp8" not in mon.summary()


def test_every_n_steps_still_feeds_the_delayed_history_every_step(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    batches = [torch.randn(6, 8) * (1 + step) for step in range(6)]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with ampaudit.watch(model, optimizer=opt, fp8=True, every=3, log=tmp_path / "w.jsonl"):
        for x in batches:
            model(x).sum().backward()
            opt.step()
    records = _records(tmp_path / "w.jsonl")
    assert [r["step"] for r in records] == [0, 3]
    row = records[1]["fp8"]["(model)"]["input"]  # steps 1 and 2 were not recorded, but are in the history
    assert row["history_amax"] == max(b.abs().max() for b in batches[:3]).item()
    assert row["jump"] == pytest.approx((batches[3].abs().max() / batches[2].abs().max()).item(), rel=1e-6)


def test_report_on_an_fp8_log_shows_the_table_and_the_verdicts(tmp_path, cli):
    torch.manual_seed(0)
    batches = [torch.randn(6, 8) for _ in range(5)]
    batches[2] = batches[2] * 50
    log = tmp_path / "w.jsonl"
    mon, _ = _train(nn.Linear(8, 4), batches, log=log)
    live = mon.summary()
    again = read_log(log).summary()
    assert again["fp8"] == live["fp8"] and again["findings"] == live["findings"]
    result = cli("report", str(log))
    assert result.code == 0
    assert "fp8 (per Linear operand" in result.out and "grad_output" in result.out
    assert "AMP750" in result.out


def test_a_damaged_fp8_row_in_a_log_is_one_line(tmp_path, cli):
    torch.manual_seed(0)
    log = tmp_path / "w.jsonl"
    _train(nn.Linear(8, 4), [torch.randn(6, 8) for _ in range(2)], log=log)
    lines = log.read_text().splitlines()
    record = json.loads(lines[1])
    record["fp8"]["(model)"]["input"]["amax"] = "big"
    lines[1] = json.dumps(record)
    log.write_text("\n".join(lines) + "\n")
    result = cli("report", str(log))
    assert result.code == 2
    assert "fp8.(model).input.amax must be a number" in result.err and "Traceback" not in result.err


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_float8_linear_modules_are_measured_as_they_run(recipe):
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    config = Float8LinearConfig.from_recipe_name(recipe)
    config = Float8LinearConfig(**{**config.__dict__, "emulate": True})
    convert_to_float8_training(model, config=config)
    assert type(model[0]).__name__ == "Float8Linear"
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(16, 32) for _ in range(3)]
    with ampaudit.watch(model, optimizer=opt, fp8=True) as mon:
        for x in xs:
            out = model(x)
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    fp8 = mon.summary()["fp8"]
    assert sorted(fp8) == ["0", "2"]
    # torchao's own word for the granularity: rowwise scales are "axiswise"
    assert fp8["0"]["kind"] == f"Float8Linear ({ {'tensorwise': 'tensorwise', 'rowwise': 'axiswise'}[recipe]})"
    grad_format = "e5m2" if recipe == "tensorwise" else "e4m3"
    assert [fp8["0"][op]["format"] for op in ("input", "weight", "grad_output")] == ["e4m3", "e4m3", grad_format]
    assert fp8["0"]["input"]["amax"] == max(x.abs().max() for x in xs).item()
    assert fp8["0"]["input"]["steps"] == 3 and fp8["0"]["input"]["numel"] == 3 * 16 * 32


def test_torchao_mxfp8_linears_are_named_as_such_not_as_a_what_if():
    # they were "Linear (what-if)" with e5m2 gradients: what tensorwise would do, not what runs
    pytest.importorskip("torchao.prototype.moe_training.config")
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.common import KernelPreference

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    quantize_(model, MXFP8TrainingOpConfig(kernel_preference=KernelPreference.EMULATED),
              filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn == "0")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampaudit.watch(model, optimizer=opt, fp8=True) as mon:
        for _ in range(2):
            model(torch.randn(32, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    fp8 = mon.summary()["fp8"]
    assert fp8["0"]["kind"] == "MXFP8 (per-tensor statistics)" and fp8["2"]["kind"] == "Linear (what-if)"
    assert [fp8["0"][op]["format"] for op in ("input", "weight", "grad_output")] == ["e4m3"] * 3
    assert fp8["0"]["input"]["steps"] == 2 and fp8["0"]["weight"]["amax"] > 0


def _cuda_train(model, opt, steps):
    x = torch.randn(16, 64, device="cuda")
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("log", [False, True])
def test_fp8_adds_no_host_sync_on_the_gpu(tmp_path, log):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _cuda_train(model, opt, 2)
    counts = {}
    for fp8 in (False, True):
        with ampaudit.watch(model, optimizer=opt, fp8=fp8, log=tmp_path / f"{fp8}.jsonl" if log else None) as mon:
            _cuda_train(model, opt, 2)  # warm-up: the rows grow, the index tensors are made
            counts[fp8] = host_syncs(lambda: _cuda_train(model, opt, 4))
        if fp8:
            assert set(mon.summary()["fp8"]) == {"0", "2"}
    assert counts[True] == counts[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_rows_on_the_gpu_are_the_cpus():
    torch.manual_seed(0)
    batches = [torch.randn(6, 8) * (30 if step == 2 else 1) for step in range(4)]
    rows = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(1)
        model = nn.Linear(8, 4).to(device)
        mon, _ = _train(model, [b.to(device) for b in batches], loss_weight=torch.ones(6, 4, device=device))
        rows[device] = mon.summary()["fp8"]
    assert rows["cuda"] == rows["cpu"]


def test_activation_checkpointing_measures_each_linear_call_once():
    """fp8=True under non-reentrant checkpointing: the recomputation in backward ran each
    Linear again, and its input and weight were measured twice (input numel 128 for 64)."""
    from tests.test_watch import _CheckpointedBlocks

    def fp8_rows(checkpointed):
        torch.manual_seed(0)
        model = _CheckpointedBlocks(checkpointed)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 8)
        with ampaudit.watch(model, optimizer=opt, fp8=True) as mon:
            for _ in range(2):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
        return mon.summary()["fp8"]

    plain = fp8_rows(None)
    assert plain["blocks.0.0"]["input"]["numel"] == 2 * 32
    assert fp8_rows("non-reentrant") == plain
