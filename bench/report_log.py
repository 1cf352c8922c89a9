"""Benchmark: `ampaudit report` on a large watch log - time and peak memory.

Writes a log of --megabytes MB (a real step record of a 12-layer MLP run, repeated with new
step numbers) to a temporary folder and runs `ampaudit report --format json` on it in a fresh
process, reporting wall time and the process's peak RSS.

Run: python bench/report_log.py [--megabytes 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A real watched run, in its own process: this one stays small, so the report's child process
# (forked from it) starts small and its peak RSS is its own.
SAMPLE = """
import json, sys, torch
from torch import nn
import ampaudit
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(12)])
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
with ampaudit.watch(model, optimizer=opt, log=sys.argv[1]):
    for _ in range(2):
        loss = model(torch.randn(8, 32)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def sample_record(folder: Path, env: dict[str, str]) -> tuple[str, dict]:
    """The header line and one step record of a real watched run."""
    log = folder / "sample.jsonl"
    subprocess.run([sys.executable, "-c", SAMPLE, str(log)], env=env, check=True)
    lines = log.read_text().splitlines()
    return lines[0], json.loads(lines[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megabytes", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        header, record = sample_record(folder, env)
        log, size, step = folder / "big.jsonl", 0, 0
        with log.open("w") as out:
            out.write(header + "\n")
            while size < args.megabytes * 1_000_000:
                record["step"] = step
                line = json.dumps(record) + "\n"
                out.write(line)
                size, step = size + len(line), step + 1
        start = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "ampaudit", "report", str(log), "--format", "json"], env=env,
                                 stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS (not the kernel build's)
        child.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - start
        assert child.returncode == 0, child.returncode
        peak_mb = usage.ru_maxrss / 1024
        print(f"log {size / 1e6:.0f} MB, {step:,} steps: {seconds:.1f} s, peak RSS {peak_mb:.0f} MB")


if __name__ == "__main__":
    main()
