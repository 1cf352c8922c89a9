"""Benchmark: `ampaudit report` on a large watch log - time and peak memory.

Writes a log of --megabytes MB (a real step record of a 12-layer MLP run, repeated with new
step numbers) to a temporary folder - or takes the log --log names (a real run's: a watched
training writes one) - and runs `ampaudit report --format json` on it in a fresh process,
reporting wall time and the process's peak RSS: with --rounds R, the median and range of R
runs. --baseline DIR times another checkout of ampaudit (a git worktree of an earlier commit)
in the same rounds, interleaved with this one, on the same log, and checks that both write the
same bytes.

Run: python bench/report_log.py [--megabytes 1000] [--log FILE] [--rounds R] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
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


def write_log(folder: Path, env: dict[str, str], megabytes: int) -> tuple[Path, int, int]:
    """A log of ``megabytes`` MB: one real step record, repeated with new step numbers."""
    header, record = sample_record(folder, env)
    log, size, step = folder / "big.jsonl", 0, 0
    with log.open("w") as out:
        out.write(header + "\n")
        while size < megabytes * 1_000_000:
            record["step"] = step
            line = json.dumps(record) + "\n"
            out.write(line)
            size, step = size + len(line), step + 1
    return log, size, step


def report_once(root: Path, log: Path, folder: Path) -> tuple[float, float, str]:
    """``ampaudit report --format json`` of ``root``'s checkout on ``log`` in a fresh process:
    its seconds, its peak RSS (MB) and the digest of what it wrote."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = folder / "report.json"
    with out.open("wb") as sink:
        start = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "ampaudit", "report", str(log), "--format", "json"],
                                 env=env, stdout=sink, cwd=folder)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS (not the kernel build's)
        seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 1), code  # 1: the run has an error finding
    return seconds, usage.ru_maxrss / 1024, hashlib.sha256(out.read_bytes()).hexdigest()


def timed(times: list[float]) -> str:
    if len(times) == 1:
        return f"{times[0]:.1f} s"
    return f"{statistics.median(times):.2f} s ({min(times):.2f}-{max(times):.2f} s, {len(times)} rounds)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megabytes", type=int, default=1000)
    parser.add_argument("--log", type=Path, help="time this log instead of writing one")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--baseline", type=Path, help="another checkout's root, timed in the same rounds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.log:
            log = args.log.resolve()
            size, step = log.stat().st_size, sum(1 for line in log.open("rb") if line.startswith(b'{"step"'))
        else:
            log, size, step = write_log(folder, {**os.environ, "PYTHONPATH": str(ROOT)}, args.megabytes)
        roots = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
        runs: dict[str, list[tuple[float, float, str]]] = {name: [] for name in roots}
        for _ in range(args.rounds):
            for name, root in roots.items():
                runs[name].append(report_once(root, log, folder))
        for name, done in runs.items():
            prefix = f"log {size / 1e6:.0f} MB, {step:,} steps" if name == "this" else f"baseline {roots[name]}"
            print(f"{prefix}: {timed([t for t, _, _ in done])}, peak RSS {max(m for _, m, _ in done):.0f} MB")
        if args.baseline:
            this, base = (statistics.median(t for t, _, _ in runs[name]) for name in ("this", "baseline"))
            same = {d for _, _, d in runs["this"]} == {d for _, _, d in runs["baseline"]}
            print(f"baseline / this: {base / this:.2f}x; the same output: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
