"""The benchmarks run end to end (tiny settings; the numbers live in docs/benchmarks.md)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # each runs a benchmark script end to end in a fresh interpreter


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _ratios(out: str) -> dict[str, float]:
    row = r"^  (\S.*?)\s+[\d.]+ ms/step\s+([\d.]+)x(?:  \([\d.]+-[\d.]+x\))?$"  # then the rounds' range
    return {m[1].strip(): float(m[2]) for m in re.finditer(row, out, re.M)}


def test_cpu_watch_benchmark_runs_every_variant():
    out = _run("bench/watch_overhead.py", "--steps", "1", "--rounds", "1", "--width", "32")
    assert "rows: C kernel" in out or "rows: torch ops" in out
    ratios = _ratios(out)
    assert set(ratios) == {"plain", "watch", "watch + log", "watch, provenance=False", "watch every=10",
                           "watch, probe_loss", "watch, torch-op rows", "naive .item() hooks", "detect_anomaly"}
    assert ratios["plain"] == 1.0


def test_fp8_watch_benchmark_runs_every_variant():
    out = _run("bench/watch_fp8.py", "--steps", "1", "--rounds", "1", "--width", "16")
    assert set(_ratios(out)) == {"plain", "watch", "watch + log", "watch fp8=True", "watch fp8=True + log"}


def test_cpu_watch_benchmark_fp16_mlp_workload():
    out = _run("bench/watch_overhead.py", "--workload", "mlp", "--steps", "1", "--rounds", "1")
    assert "fp16 autocast + GradScaler" in out
    ratios = _ratios(out)
    assert {"plain", "watch", "watch + log", "watch every=10", "detect_anomaly"} <= set(ratios)


def test_gpu_watch_benchmark_smoke_mode_runs_on_the_cpu():
    ratios = _ratios(_run("bench/watch_gpu.py", "--smoke"))
    assert {"plain", "watch", "watch every=10", "naive .item() hooks", "detect_anomaly"} <= set(ratios)


def test_gpu_watch_benchmark_runs_without_libcst_or_transformers():
    # The GPU machine has neither: the benchmark must import only what watch needs, and fall
    # back to the GPT-2 built in code.
    code = ("import runpy, sys\nsys.modules['libcst'] = sys.modules['transformers'] = None\n"
            "sys.argv = ['bench/watch_gpu.py', '--smoke']\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    out = _run("-c", code)
    assert out.startswith("GPT-2 (bench/gpt2_model.py)")
    assert set(_ratios(out)) == {"plain", "watch", "watch every=10", "naive .item() hooks", "detect_anomaly"}


def test_report_benchmark_runs():
    out = _run("bench/report_log.py", "--megabytes", "1")
    assert re.match(r"log 1 MB, [\d,]+ steps: [\d.]+ s, peak RSS \d+ MB$", out.strip()), out


def test_report_benchmark_times_a_log_against_a_baseline(tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text((ROOT / "fixtures" / "watch" / "AMP605_invalid.jsonl").read_text())
    out = _run("bench/report_log.py", "--log", str(log), "--rounds", "2", "--baseline", str(ROOT))
    lines = out.strip().splitlines()
    assert re.match(r"log 0 MB, \d+ steps: [\d.]+ s \([\d.]+-[\d.]+ s, 2 rounds\), peak RSS \d+ MB$", lines[0]), out
    assert lines[1].startswith(f"baseline {ROOT}: ") and lines[2].endswith("the same output: yes"), out


def test_convert_time_benchmark_runs():
    out = _run("bench/convert_time.py", "--size", "32", "--batch", "1", "--train-steps", "1")
    assert "convert (trace, measure, verify, search):" in out and "with the training check (1 steps)" in out


def test_install_size_benchmark_runs_for_the_lint():
    pytest.importorskip("hatchling", reason="the benchmark builds ampaudit's wheel offline")
    out = _run("bench/install_size.py", "--lint-only", "--rounds", "1")
    assert re.search(r"^ampaudit \(the lint\) +[\d.]+ MB in site-packages .* \d+ distributions\)", out, re.M), out


def test_check_vs_lint_benchmark_runs(tmp_path):
    (tmp_path / "train.py").write_text("import torch\nfrom torch import nn\n\n\nclass Net(nn.Module):\n"
                                       "    pass\n\n\nfor step in range(3):\n    print(step)\n")
    out = _run("bench/check_vs_lint.py", str(tmp_path), "--rounds", "1")
    assert "train.py" in out and re.search(r"^this\s+not-imported\s+1 files: check / lint-only median", out, re.M)


def test_fp8_check_cost_benchmark_runs():
    out = _run("bench/fp8_check_cost.py", "--rounds", "1", "--shapes", "64x32", "--threads", "1")
    assert re.search(r"^d=64 T=32: fp32 forward\+backward [\d.]+ ms, fp8 audit [\d.]+ ms: [\d.]+x \(", out, re.M)


def test_fp8_predict_benchmark_trains_every_configuration():
    pytest.importorskip("torchao.float8")
    out = _run("bench/fp8_predict.py", "--models", "sink", "--steps", "4", "--seeds", "0,1", "--fp32", "--per-layer")
    assert "kept by the check (tensorwise), per seed: [{'fc1': ['AMP702']}, {'fc1': ['AMP702']}]" in out
    for label in ("null: reference", "'keep' layers in fp8", "as many 'fp8' layers", "policy (all but 'keep')",
                  "'keep' layers, rowwise ", "'keep' layers, rowwise_with_gw_hp", "every layer", "Spearman"):
        assert label in out, label


def test_probe_memory_benchmark_runs_every_variant():
    out = _run("bench/probe_memory.py", "--ops", "4", "--vocab", "64", "--steps", "1")
    peaks = re.findall(r"^  (\S.*?)\s+peak RSS\s+(\d+) MB$", out, re.M)
    assert [name for name, _ in peaks] == ["no watch", "watch", "watch, probe_loss"]
