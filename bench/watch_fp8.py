"""Benchmark: what watch(..., fp8=True) costs per training step, and that the fp16 statistics'
path (fp8 off) costs what it did before it: A/B interleaved in one run (``ab.interleaved``),
each ratio the median over rounds of a variant's time over the plain step's timed just
before it.

Variants: a plain step; watch (the fp16 statistics, fp8 off); watch with the log; watch with
fp8=True; fp8=True with the log. Workload: bench/watch_overhead.py's TinyGPT (4 blocks, 17
Linears, fp32, CPU).

To compare the fp16 path with an older ampaudit, run this script with ``--ampaudit DIR`` (a
checkout or an export of that version): it imports ampaudit from there, and leaves out the fp8
variants if that version has no fp8 option; alternate runs of the two versions and compare
their "watch" ratios.

Run: python bench/watch_fp8.py [--steps N] [--rounds R] [--width D] [--ampaudit DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=128, help="model width d (4 heads, 4 blocks)")
    parser.add_argument("--ampaudit", type=Path, default=HERE.parent, help="the ampaudit checkout to import")
    args = parser.parse_args()
    sys.path[:0] = [str(args.ampaudit.resolve()), str(HERE)]

    import ab
    import torch

    import ampaudit
    from ampaudit.watch.options import WatchOptions

    TinyGPT = importlib.import_module("watch_overhead").TinyGPT  # after ampaudit: it puts this checkout on sys.path

    torch.manual_seed(0)
    model = TinyGPT(d=args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, 512, (8, 128))
    targets = torch.roll(idx, -1, 1)

    def step():
        loss = model(idx, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    log_dir = tempfile.mkdtemp(prefix="ampaudit-bench-")

    def watched(log=False, **options):
        path = None
        if log:
            path = os.path.join(log_dir, "run.jsonl")
            if os.path.exists(path):
                os.unlink(path)
        return ampaudit.watch(model, optimizer=opt, log=path, **options)

    variants = {"plain": contextlib.nullcontext, "watch": watched, "watch + log": lambda: watched(log=True)}
    has_fp8 = "fp8" in {f.name for f in dataclasses.fields(WatchOptions)}
    if has_fp8:
        variants["watch fp8=True"] = lambda: watched(fp8=True)
        variants["watch fp8=True + log"] = lambda: watched(log=True, fp8=True)
    medians = ab.interleaved(variants, step, steps=args.steps, rounds=args.rounds, warmup=2)
    print(f"TinyGPT (4 blocks, d={args.width}, batch 8 x 128), cpu, {torch.get_num_threads()} threads, "
          f"median of {args.rounds} rounds x {args.steps} steps; ampaudit from {ampaudit.__file__}")
    ab.print_ratios(medians)


if __name__ == "__main__":
    main()
