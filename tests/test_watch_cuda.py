"""watch on a CUDA device: the Triton rows against the torch ops, and one host sync per
logged step. Skipped without a GPU; run on the device with ``pytest tests/test_watch_cuda.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampaudit
from ampaudit.core.dtypes import LowDtype
from ampaudit.watch import stats, triton_stats
from tests.conftest import host_syncs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SPECIAL = [0.0, -0.0, 1.0, 65504.0, 65519.996, 65520.0, -1e5, 6e-5, 1e-7, 3e-8, 1e-40, 3.4e38,
           float("inf"), -float("inf"), float("nan")]


def _values(n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.logspace(-30, 30, n, dtype=torch.float64)
    x[: len(SPECIAL)] = torch.tensor(SPECIAL, dtype=torch.float64)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [15, 8193, 3 * 2**20 + 5])
def test_triton_rows_match_the_torch_ops(dtype, n):
    assert triton_stats.available()
    limits = LowDtype.parse(torch.float16)
    x = _values(n, dtype)
    scale = torch.tensor(1024.0, device="cuda")
    kernel = stats.new_row(torch.device("cuda"))
    triton_stats.fill_row(x.cuda(), *kernel, limits.overflow_at, norm=True, scale=scale, limit=limits.max)
    ops = stats.new_row(torch.device("cpu"))
    stats.torch_fill_row(x, *ops, limits)
    stats.fill_param_extras(x, *ops, limits, norm=True, scale=scale.cpu())
    counts, extras = (t.cpu() for t in kernel)
    nan_bins = slice(255 * 4 + 1, 256 * 4)  # which quiet NaN a conversion makes is the library's choice
    assert torch.equal(counts[: nan_bins.start], ops[0][: nan_bins.start])
    assert int(counts[nan_bins].sum()) == int(ops[0][nan_bins].sum())
    assert torch.equal(counts[1024:], ops[0][1024:])  # overflow at scale, overflow
    assert float(extras[0]) == float(ops[1][0])  # finite absmax
    assert torch.isnan(extras[1]) == torch.isnan(ops[1][1])  # the NaN makes the sum of squares NaN


def test_torch_op_rows_on_the_gpu_match_the_cpu():
    limits = LowDtype.parse(torch.float16)
    x = _values(100_003, torch.float32)
    gpu, cpu = stats.new_row(torch.device("cuda")), stats.new_row(torch.device("cpu"))
    stats.torch_fill_row(x.cuda(), *gpu, limits)
    stats.torch_fill_row(x, *cpu, limits)
    assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])


def test_triton_sum_of_squares_of_a_large_gradient():
    g = torch.randn(5_000_000, generator=torch.Generator().manual_seed(0))
    counts, extras = stats.new_row(torch.device("cuda"))
    triton_stats.fill_row(g.cuda(), counts, extras, LowDtype.parse(torch.float16).overflow_at, norm=True)
    assert float(extras[1]) == pytest.approx(float(g.double().square().sum()), rel=1e-4)


def _train(model, opt, scaler, steps):
    x = torch.randn(16, 64, device="cuda")
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("rows", ["triton", "torch ops"])
@pytest.mark.parametrize("log", [False, True])
def test_one_host_sync_per_logged_step(tmp_path, monkeypatch, log, rows):
    if rows == "torch ops":
        monkeypatch.setattr(triton_stats, "available", lambda: False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    _train(model, opt, scaler, 2)  # warm-up: lazy state, Triton compilation
    plain = host_syncs(lambda: _train(model, opt, scaler, 4))
    with ampaudit.watch(model, optimizer=opt, scaler=scaler, log=tmp_path / "run.jsonl" if log else None):
        _train(model, opt, scaler, 1)
        watched = host_syncs(lambda: _train(model, opt, scaler, 4))
    assert watched - plain == 4


def test_first_nonfinite_on_the_gpu():
    class Blowup(nn.Module):
        calls = 0

        def forward(self, x):
            self.calls += 1
            return x * (float("inf") if self.calls == 3 else 1.0)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), Blowup(), nn.Linear(64, 8)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    with ampaudit.watch(model, optimizer=opt, scaler=scaler) as mon:
        _train(model, opt, scaler, 4)
    summary = mon.summary()
    assert summary["first_nonfinite"] == {"step": 2, "module": "1", "phase": "forward", "tensor": "output"}
    assert summary["scaler"]["skipped_steps"] == [2]
    assert summary["layers"]["0"]["forward"]["numel"] == 4 * 16 * 64
