"""Benchmark: training GPT-2 (built in code) in fp32, with torch.autocast + GradScaler, and
converted by ampaudit.convert - step time, peak memory and loss after N steps, one process
per variant (so peak memory is each variant's own).

On a GPU: GPT-2 small, batch 8 x 1024 tokens (not run on a GPU yet, so there are no GPU
numbers to compare with). On a CPU the model and batch shrink and the ratios are what
matters (fp16 matmuls are slow on most CPUs); docs/benchmarks.md has the CPU numbers.

Run: python bench/convert_speed.py [--steps N] [--layers L] [--batch B] [--tokens T]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("fp32", "autocast", "convert", "convert-fp32w")


def run_variant(variant: str, steps: int, batch: int, tokens: int) -> dict[str, float]:
    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from gpt2_model import get_model

    import ampaudit

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = get_model().to(device)
    ids = torch.randint(0, 50257, (batch, tokens + 1), device=device)
    ids, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # next-token prediction
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    if variant.startswith("convert"):  # convert-fp32w: the modules backend, fp32 weights cast at each use
        options = {"backend": "modules", "weights": "fp32"} if variant == "convert-fp32w" else {}
        model, optimizer = ampaudit.convert(model, optimizer, example_inputs=(ids[:1, :64], targets[:1, :64]),
                                            verify=False, **options)

    def step() -> float:
        if variant == "fp32":
            loss = model(ids, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        elif variant == "autocast":
            with torch.autocast(device, dtype=torch.float16):
                loss = model(ids, targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss = model(ids, targets)
            optimizer.zero_grad()
            optimizer.backward(loss)
            optimizer.step()
        return float(loss)

    def backward_only() -> None:
        if variant == "autocast":
            with torch.autocast(device, dtype=torch.float16):
                loss = model(ids, targets)
            scaler.scale(loss).backward()
        elif variant.startswith("convert"):
            optimizer.backward(model(ids, targets))
        else:
            model(ids, targets).backward()

    scaler = torch.amp.GradScaler(device) if variant == "autocast" else None
    for _ in range(2):  # warm-up
        step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], 0.0
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    backward_only()  # gradients alive, for training_state_bytes
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"ms_per_step": statistics.median(times) * 1000, "peak_bytes": peak, "loss": loss, "device": device,
            **training_state_bytes(model, optimizer)}


def training_state_bytes(model, optimizer) -> dict[str, int]:
    """Bytes of what training keeps between steps, each tensor counted once: parameters,
    fp32 masters, gradients (low and fp32) and optimizer state - measured right after a
    backward, when the gradients are alive."""
    import torch

    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    inner = getattr(optimizer, "optimizer", optimizer)  # ampaudit's MixedPrecisionOptimizer wraps one
    masters = [m for _, m in getattr(optimizer, "pairs", [])]
    params = list(model.parameters())
    out = {"params": size(params), "masters": size(masters)}
    out["grads"] = size(p.grad for p in params + masters)
    out["state"] = size(v for state in inner.state.values() for v in state.values())
    out["state_bytes"] = sum(out.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in a child process
    args = parser.parse_args()
    import torch

    gpu = torch.cuda.is_available()
    steps = args.steps or (20 if gpu else 3)
    batch = args.batch or (8 if gpu else 2)
    tokens = args.tokens or (1024 if gpu else 64)
    if args.variant:
        print(json.dumps(run_variant(args.variant, steps, batch, tokens)))
        return
    env = dict(os.environ)
    env.setdefault("GPT2_LAYERS", str(args.layers or (12 if gpu else 2)))
    results = {}
    for variant in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--variant", variant, "--steps", str(steps), "--batch",
                               str(batch), "--tokens", str(tokens)], env=env, capture_output=True, text=True,
                              check=True)
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    device = results["fp32"]["device"]
    print(f"GPT-2 ({env['GPT2_LAYERS']} layers), batch {batch} x {tokens} tokens, {steps} timed steps, {device}")
    print(f"  {'variant':<10} {'ms/step':>9} {'x autocast':>11} {'peak':>10} {'loss':>8}   "
          f"{'params':>8} {'masters':>8} {'grads':>8} {'opt state':>9} {'total MiB':>9} {'x autocast':>10}")
    base = results["autocast"]["ms_per_step"]
    base_state = results["autocast"]["state_bytes"]
    mib = 2**20
    for variant, r in results.items():
        print(f"  {variant:<10} {r['ms_per_step']:9.1f} {r['ms_per_step'] / base:11.2f} "
              f"{r['peak_bytes'] / 2**30:8.2f} GiB {r['loss']:8.4f}   {r['params'] / mib:8.1f} "
              f"{r['masters'] / mib:8.1f} {r['grads'] / mib:8.1f} {r['state'] / mib:9.1f} "
              f"{r['state_bytes'] / mib:9.1f} {r['state_bytes'] / base_state:10.2f}")


if __name__ == "__main__":
    main()
