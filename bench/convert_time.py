"""Benchmark: how long ``ampaudit.convert`` takes on an EfficientNet-B0-shaped CNN (5.3M
parameters, 16 MBConv blocks with squeeze-excitation; bench/effnet_b0.py, no timm needed):
tracing, measuring, verifying against fp32 and the promotion search, then the training
check (20 AdamW steps of both models) separately, since on a CPU its fp16 steps dominate.

Run: python bench/convert_time.py [--batch 2] [--train-steps 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from effnet_b0 import EfficientNetB0  # noqa: E402

import ampaudit  # noqa: E402
import ampaudit.convert.api as convert_api  # noqa: E402
import ampaudit.convert.verify as verify  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--train-steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = EfficientNetB0().eval()
    x = (torch.randn(args.batch, 3, args.size, args.size),)
    comparisons = {"n": 0}
    original = verify.output_error

    def counted(*a, **k):
        comparisons["n"] += 1
        return original(*a, **k)

    verify.output_error = convert_api.output_error = counted  # each comparison is one converted forward
    start = time.perf_counter()
    model_mp = ampaudit.convert(model, x)
    seconds = time.perf_counter() - start
    summary = model_mp.summary
    print(f"EfficientNet-B0 shape, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"batch {args.batch} x 3 x {args.size} x {args.size}")
    print(f"  convert (trace, measure, verify, search): {seconds:6.1f} s, {comparisons['n']} comparisons, "
          f"{len(summary.promoted)} promoted, error {summary.error_after:.2e}")
    if args.train_steps:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        start = time.perf_counter()
        model_mp, _ = ampaudit.convert(model, optimizer, example_inputs=x, train_steps=args.train_steps)
        total = time.perf_counter() - start
        print(f"  with the training check ({args.train_steps} steps): {total:6.1f} s "
              f"(passed: {model_mp.summary.train['passed']})")


if __name__ == "__main__":
    main()
