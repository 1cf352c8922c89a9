"""The sampled row (watch's default for a module's tensors on the CPU): every count exact, the
magnitude histogram estimated from about ``LAYOUT.hist_sample`` elements."""

from __future__ import annotations

import pytest
import torch

import ampaudit
from ampaudit.core.dtypes import LowDtype
from ampaudit.watch import cpu_kernel, stats
from ampaudit.watch.layout import LAYOUT

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason=f"no C kernel: {cpu_kernel.status()}")

FP16, BF16 = LowDtype.parse(torch.float16), LowDtype.parse(torch.bfloat16)
SAMPLED_FROM = LAYOUT.hist_sample_above + 1  # smaller tensors are binned whole


def _stats(x: torch.Tensor, limits: LowDtype, *, sampled: bool) -> dict:
    counts, extras = stats.new_row(x.device)
    if sampled:
        cpu_kernel.fill_sampled_row(x, counts, extras, limits.overflow_at, limits.normal_exponent)
    else:
        cpu_kernel.fill_row(x, counts, extras, limits.overflow_at)
    return stats.to_stats(stats.compact_rows(counts[None], extras[None], limits)[0].tolist())


def _planted(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """n values over 16 decades, with zeros, fp16 underflow, overflow, NaN and both infinities
    planted in several places (in more than one 65536-element piece where n allows)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.logspace(-10, 6, n)
    for at in (0, n // 3, n - 5):
        x[at: at + 5] = torch.tensor([0.0, float("nan"), float("inf"), -float("inf"), 7e4])
    x[n // 2: n // 2 + 100] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [SAMPLED_FROM, 50_000, 3 * 65536 + 7])  # 3 * 65536 + 7: several pieces
@pytest.mark.parametrize("threads", [1, 2])
def test_every_count_is_the_exact_rows(dtype, n, threads):
    x = _planted(n, dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for limits in (FP16, BF16):
            exact, sampled = _stats(x, limits, sampled=False), _stats(x, limits, sampled=True)
            assert {k: v for k, v in sampled.items() if k != "hist"} == {k: v for k, v in exact.items() if k != "hist"}
            assert exact["nan"] == 3 and exact["inf"] >= 6 and exact["neginf"] >= 3  # float16: more, converted
            assert exact["zero"] > 100 and exact["overflow"] and (exact["underflow"] or limits is BF16)
            # the histogram's classes keep their exact totals; every bin it fills holds values
            low = limits.normal_exponent - 127
            for below in (True, False):
                assert sum(c for e, c in sampled["hist"] if (e < low) == below) == \
                    sum(c for e, c in exact["hist"] if (e < low) == below)
            assert {e for e, _ in sampled["hist"]} <= {e for e, _ in exact["hist"]}
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("limits", [FP16, BF16])
@pytest.mark.parametrize("special", ["edge", "nan"])
def test_overflow_is_counted_exactly_at_its_edge(limits, special):
    """The overflow and non-finite counts are taken only where a piece's max reaches the edge:
    a value just at it counts, the float just below does not, whatever else is there."""
    edge = torch.tensor(limits.overflow_at)
    below = torch.nextafter(edge, torch.tensor(0.0))
    x = torch.randn(3 * 65536 + 7, generator=torch.Generator().manual_seed(1)) * 1e-2
    x[5], x[70_000], x[-3] = edge, below, -edge  # one piece with an overflow, one without, the last signed
    if special == "nan":
        x[140_000] = float("nan")
    exact, sampled = _stats(x, limits, sampled=False), _stats(x, limits, sampled=True)
    assert sampled["overflow"] == exact["overflow"] == 2
    assert sampled["nan"] == exact["nan"] == (special == "nan")
    assert sampled["absmax"] == exact["absmax"] == limits.overflow_at


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_pattern_is_counted_as_the_exact_row_counts_it(dtype):
    x = torch.arange(-(2**15), 2**15).to(torch.int16).view(dtype)  # every NaN payload, both zeros, both infs
    for limits in (FP16, BF16):
        exact, sampled = _stats(x, limits, sampled=False), _stats(x, limits, sampled=True)
        assert {k: v for k, v in sampled.items() if k != "hist"} == {k: v for k, v in exact.items() if k != "hist"}
        assert sum(c for _, c in sampled["hist"]) == sum(c for _, c in exact["hist"])


def test_a_small_tensor_is_binned_whole():
    x = _planted(SAMPLED_FROM - 1, torch.float32)
    assert _stats(x, FP16, sampled=True) == _stats(x, FP16, sampled=False)


def test_the_histogram_follows_the_values():
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(1))
    exact, sampled = (dict(map(tuple, _stats(x, FP16, sampled=s)["hist"])) for s in (False, True))
    for e, count in exact.items():
        if count > 0.05 * x.numel():  # the bulk: within 15% of the exact counts
            assert abs(sampled.get(e, 0) - count) < 0.15 * count, e


@pytest.mark.parametrize("shape", ["normal", "lognormal", "relu"])
def test_the_estimated_histogram_is_near_the_exact_one(shape):
    # what LAYOUT.hist_sample buys (docs/watch.md): 2048 binned of 49,152 (a nanoGPT activation)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(49_152, generator=gen)
    x = {"normal": x, "lognormal": torch.exp(3 * x), "relu": x.clamp(min=0)}[shape]
    exact, sampled = (dict(map(tuple, _stats(x, FP16, sampled=s)["hist"])) for s in (False, True))
    assert sum(sampled.values()) == sum(exact.values())  # every class total exact (zeros apart)
    distance = sum(abs(exact.get(e, 0) - sampled.get(e, 0)) for e in exact.keys() | sampled.keys()) / 2
    assert distance < 0.05 * x.numel()  # 0.015-0.042 measured


def test_a_column_the_stride_would_divide_is_sampled_at_its_share():
    # 65 columns (nanoGPT's vocabulary): a fixed stride of 13 would see 5 of them; column 0 huge
    x = torch.full((1200, 65), 0.5)
    x[:, 0] = 1000.0
    hist = dict(map(tuple, _stats(x, FP16, sampled=True)["hist"]))
    share = hist[9] / x.numel()  # 1000 = 1.95 * 2**9
    assert 0.5 / 65 < share < 2 / 65


def test_values_the_sample_misses_land_in_the_bin_of_their_largest():
    x = torch.ones(100_000)
    x[[10, 50_000, 99_999]] = torch.tensor([1e-6, 3e-6, 2e-6])  # fp16 underflow, three values
    x[[20, 60_000]] = torch.tensor([3.0e4, 6.0e4])
    s = _stats(x, FP16, sampled=True)
    assert s["underflow"] == 3 and s["absmax"] == 6.0e4
    hist = dict(map(tuple, s["hist"]))
    assert hist[-19] == 3  # 3e-6 = 1.57 * 2**-19: all three there
    assert sum(hist.values()) == x.numel() and hist[0] >= 99_990


def test_the_same_tensor_gives_the_same_row():
    x = _planted(100_000, torch.float32)
    assert _stats(x, FP16, sampled=True) == _stats(x, FP16, sampled=True)


@pytest.mark.parametrize("make", [
    lambda: _planted(100_000, torch.float32), lambda: _planted(100_000, torch.bfloat16),
    lambda: _planted(3_000, torch.float16),  # binned whole
    lambda: _planted(200_000, torch.float32).view(400, 500)[:, ::2],  # not dense: copied first
    lambda: _planted(50_000, torch.float64),  # no kernel for its dtype: as float32
], ids=["f32", "bf16", "small f16", "strided", "f64"])
def test_a_recorded_tensor_gets_the_row_the_kernel_gives(make):
    """The recorder writes a CPU row at its address (``arena.take_cpu``): the same row as
    ``stats.fill_sampled_row`` into a fresh one, byte for byte."""
    from ampaudit.watch.hooks import StepRecorder

    x = make()
    recorder = StepRecorder(FP16, "given", record_inputs=False, record_eval=False)
    recorder.record("m", "forward", x, "output")
    counts, extras = recorder.arena.row(recorder.event_rows[0])
    want_counts, want_extras = stats.new_row(x.device)
    stats.fill_sampled_row(x, want_counts, want_extras, FP16)
    assert torch.equal(counts, want_counts) and torch.equal(extras, want_extras)
    assert counts[:LAYOUT.bins].sum() == x.numel()  # a row was written at all


def _run(exact_histograms: bool, log) -> list[dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(128, 64)
    with ampaudit.watch(model, optimizer=opt, log=log, exact_histograms=exact_histograms):
        for _ in range(2):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    import json

    header, *records = map(json.loads, log.read_text().splitlines())
    assert header["hist_sample"] == (0 if exact_histograms else LAYOUT.hist_sample)  # the log says which
    return [r for r in records if "step" in r]


def test_watch_samples_big_tensors_by_default_and_bins_all_with_exact_histograms(tmp_path):
    sampled, exact = _run(False, tmp_path / "s.jsonl"), _run(True, tmp_path / "e.jsonl")
    assert len(sampled) == 2
    n_fields = len(LAYOUT.fields)
    differs = 0
    for a, b in zip(sampled, exact, strict=True):
        assert a.keys() == b.keys() and a["params"] == b["params"]  # parameter rows: always exact
        for module, phases in b["layers"].items():
            for phase, row in phases.items():
                assert a["layers"][module][phase][:n_fields] == row[:n_fields], (module, phase)
                differs += a["layers"][module][phase] != row
    assert differs  # the 128 x 256 tensors (32768 elements) are sampled, and their histograms differ


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "sliced"])
def test_a_dense_tensor_in_another_order_is_read_where_it_lies(monkeypatch, layout):
    x = _planted(8 * 16 * 12 * 12, torch.float32).view(8, 16, 12, 12)
    view = {"channels_last": x.to(memory_format=torch.channels_last), "transposed": x.transpose(0, 3),
            "sliced": x[:, :, :, :6]}[layout]
    rows = [(_stats(view.contiguous(), FP16, sampled=s), s) for s in (False, True)]
    if layout != "sliced":  # dense: read in place, never copied
        monkeypatch.setattr(torch.Tensor, "contiguous", lambda *a, **k: pytest.fail("copied"))
    for want, sampled in rows:
        got = _stats(view, FP16, sampled=sampled)
        assert got == want if not sampled else {k: v for k, v in got.items() if k != "hist"} == \
            {k: v for k, v in want.items() if k != "hist"}


def test_without_the_c_kernel_the_log_says_every_element_was_binned(tmp_path, monkeypatch):
    """AMPAUDIT_CPU_KERNEL=0 or no compiler: the torch ops bin every element, and the header's
    hist_sample said 4096 (a histogram estimated) all the same."""
    monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    log = tmp_path / "t.jsonl"
    with ampaudit.watch(torch.nn.Linear(4, 4), log=log):
        torch.nn.Linear(4, 4)(torch.ones(1, 4))
    import json

    assert json.loads(log.read_text().splitlines()[0])["hist_sample"] == 0
