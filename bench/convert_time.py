"""Benchmark: how long ``ampaudit.convert`` takes on an EfficientNet-B0-shaped CNN (5.3M
parameters, 16 MBConv blocks with squeeze-excitation; bench/effnet_b0.py, no timm needed):
tracing, measuring, verifying against fp32 and the promotion search, then the training
check (20 AdamW steps of both models) separately, since on a CPU its fp16 steps dominate.

``--offending`` prints the promotion search's forward passes on models with 1 to 10
offending ops (fixtures/models/offending_ops.py) in both backends instead.

Run: python bench/convert_time.py [--batch 2] [--train-steps 20] [--offending]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--train-steps", type=int, default=20)
    parser.add_argument("--offending", action="store_true", help="the search's forward passes, 1-10 offending ops")
    args = parser.parse_args()
    if args.offending:
        offending_table()
        return
    torch.manual_seed(0)
    model = EfficientNetB0().eval()
    x = (torch.randn(args.batch, 3, args.size, args.size),)
    start = time.perf_counter()
    model_mp = ampaudit.convert(model, x)
    seconds = time.perf_counter() - start
    summary = model_mp.summary
    print(f"EfficientNet-B0 shape, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"batch {args.batch} x 3 x {args.size} x {args.size}")
    print(f"  convert (trace, measure, verify, search): {seconds:6.1f} s, {summary.search['forwards']} search "
          f"forward passes, "
          f"{len(summary.promoted)} promoted, error {summary.error_after:.2e}")
    if args.train_steps:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        start = time.perf_counter()
        model_mp, _ = ampaudit.convert(model, optimizer, example_inputs=x, train_steps=args.train_steps)
        total = time.perf_counter() - start
        print(f"  with the training check ({args.train_steps} steps): {total:6.1f} s "
              f"(passed: {model_mp.summary.train['passed']})")


def offending_table() -> None:
    """Forward passes of the promotion search (the fp32 reference, the first comparison, one
    per promotion set tried), counted, on the offending-ops fixture."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("offending_ops", ROOT / "fixtures/models/offending_ops.py")
    offending = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(offending)
    x = offending.example_inputs()
    print(f"  {'model':<34} {'backend':<8} {'forwards':>8} {'promoted':>8} {'error before':>12} "
          f"{'after':>9} {'convert s':>9}")
    cases = [(f"{n} offending", {"n": n}) for n in (1, 3, 5, 10)]
    cases += [("3 offending + 2 hidden", {"n": 3, "hidden": 2}), ("5 offending + 5 hidden", {"n": 5, "hidden": 5}),
              ("3 offending, top level untraced", {"n": 3, "traceable": False})]
    for label, options in cases:
        for backend in ("fx", "modules"):
            model = offending.build(**options)
            start = time.perf_counter()
            summary = ampaudit.convert(model, x, backend=backend).summary
            seconds = time.perf_counter() - start
            print(f"  {label:<34} {backend:<8} {summary.search['forwards']:8d} {len(summary.promoted):8d} "
                  f"{summary.error_before:12.3g} {summary.error_after:9.2g} {seconds:9.2f}")


if __name__ == "__main__":
    main()
