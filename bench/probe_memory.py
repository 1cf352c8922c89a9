"""Benchmark: the loss probe's memory - peak RSS of a loop whose loss code makes many large
tensors, without watch, with the watch, and with ``probe_loss`` (whose kept calls hold what they
made until the step's end, at most ``probe_loss_mb`` of it: watch/probe_budget.py).

The loop: an MLP (256 -> 1024 -> VOCAB logits, batch 64), then OPS elementwise ops over the
logits in the loss code (tanh and a multiply-add in turn), a cross-entropy, SGD. Each variant
runs in a fresh interpreter with ``MALLOC_MMAP_THRESHOLD_`` fixed: glibc's moving threshold made
the same run's peak differ by 1 GB from one run to the next.

Run: python bench/probe_memory.py [--ops N] [--vocab V] [--steps S] [--probe-loss-mb MB]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("no watch", "watch", "watch, probe_loss")


def _one(variant: str, args: argparse.Namespace) -> None:
    """One variant, in this interpreter: print its peak RSS in MB."""
    import resource

    import torch

    import ampaudit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, args.vocab))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randint(0, args.vocab, (64,))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        z = logits
        for i in range(args.ops):
            z = z * 0.999 + 0.001 if i % 2 else torch.tanh(z)
        return torch.nn.functional.cross_entropy(z, y)

    options = {"no watch": None, "watch": {}, "watch, probe_loss": {"probe_loss": True,
                                                                     "probe_loss_mb": args.probe_loss_mb}}[variant]
    watch = ampaudit.watch(model, optimizer=opt, **options) if options is not None else None
    if watch is not None:
        watch.__enter__()
    for _ in range(args.steps):
        opt.zero_grad()
        loss_fn(model(x)).backward()
        opt.step()
    if watch is not None:
        watch.__exit__(None, None, None)
    print(f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--probe-loss-mb", type=int, default=256)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    if args.variant:
        _one(args.variant, args)
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": str(ROOT)}
    print(f"loss code: {args.ops} elementwise ops over 64 x {args.vocab} fp32 logits, {args.steps} steps, "
          f"probe_loss_mb={args.probe_loss_mb}")
    for variant in VARIANTS:
        argv = [sys.executable, __file__, "--variant", variant, "--ops", str(args.ops), "--vocab", str(args.vocab),
                "--steps", str(args.steps), "--probe-loss-mb", str(args.probe_loss_mb)]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.split()[-1]
        print(f"  {variant:<20} peak RSS {out:>6} MB")


if __name__ == "__main__":
    main()
