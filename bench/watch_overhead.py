"""Benchmark: the cost of ampaudit.watch per training step, A/B interleaved in one run: each
variant's ratio is the median over rounds of its time over the plain step's, timed just before
it (``ab.interleaved``).

Variants: a plain step; ampaudit.watch (every step, every 10th, and every step with the
torch-op rows instead of the C kernel); per-module hooks that call .item() on each
statistic (the naive approach); torch.autograd.detect_anomaly.
CPU: a small transformer in fp32, audited for float16 (targets, with the log `ampaudit run`
writes: <= 1.25x every step, <= 1.05x every 10th); and with --workload mlp a small MLP under
fp16 autocast with a GradScaler, next to transformers' DebugUnderflowOverflow (target <= 1.5x).
(The GPU benchmark, GPT-2 small with autocast, is bench/watch_gpu.py.)

With --compile the model is torch.compile'd (inductor): the compiled run against watch (the
graph untouched), watch with the log, and watch(inside_compile=True) (every module inside the
graph recorded by an op in it), with the log too.

Run: python bench/watch_overhead.py [--workload gpt|mlp] [--compile] [--steps N] [--rounds R] [--width D]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ab

import ampaudit
from ampaudit.watch import cpu_kernel


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=512, d=128, layers=4, heads=4, ctx=128) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=128, help="model width d (4 heads, 4 blocks)")
    parser.add_argument("--workload", choices=("gpt", "mlp"), default="gpt",
                        help="gpt: TinyGPT in fp32; mlp: a small MLP, fp16 autocast and a GradScaler")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    args = parser.parse_args()
    device = "cpu"
    torch.manual_seed(0)
    scaler = None
    if args.workload == "gpt":
        model = TinyGPT(d=args.width).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        idx = torch.randint(0, 512, (8, 128), device=device)
        targets = torch.roll(idx, -1, 1)

        def step():
            loss = model(idx, targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        title = f"TinyGPT (4 blocks, d={args.width}, batch 8 x 128)"
    else:
        model = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(256, 256), nn.ReLU())],
                              nn.Linear(256, 10)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
        x, y = torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)

        def step():
            with torch.autocast(device, dtype=torch.float16):
                loss = F.cross_entropy(model(x).float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        title = "MLP (5 Linear, 256 wide, batch 64), fp16 autocast + GradScaler"

    if args.compile:  # the steps above read `model` when they run: the compiled one from here on
        model = torch.compile(model)
        title += ", torch.compile (inductor)"

    def watched(every=1, **options):
        return ampaudit.watch(model, optimizer=opt, scaler=scaler, every=every, **options)

    log_dir = tempfile.mkdtemp(prefix="ampaudit-bench-")

    def logged(**options):  # what `ampaudit run` does: a log written every step
        path = os.path.join(log_dir, "run.jsonl")
        if os.path.exists(path):
            os.unlink(path)
        return watched(log=path, **options)

    @contextlib.contextmanager
    def torch_rows():
        with mock.patch.object(cpu_kernel, "available", lambda: False), watched():
            yield

    variants = {"plain": contextlib.nullcontext, "watch": watched, "watch + log": logged,
                "watch, provenance=False": lambda: watched(provenance=False), "watch every=10": lambda: watched(10),
                "watch, torch-op rows": torch_rows, "naive .item() hooks": lambda: ab.item_hooks(model),
                "detect_anomaly": ab.anomaly}
    if args.compile:
        variants = {"compiled": contextlib.nullcontext, "watch": watched, "watch + log": logged,
                    "watch every=10": lambda: watched(10), "inside_compile": lambda: watched(inside_compile=True),
                    "inside_compile + log": lambda: logged(inside_compile=True)}
    elif args.workload == "mlp":
        try:
            import transformers  # noqa: F401
            variants["HF DebugUnderflowOverflow"] = lambda: ab.hf_debug(model)
        except ImportError:
            pass
    medians = ab.interleaved(variants, step, steps=args.steps, rounds=args.rounds, warmup=2)
    print(f"{title}, {device}, {torch.get_num_threads()} threads, "
          f"median of {args.rounds} rounds x {args.steps} steps; rows: {cpu_kernel.status()}")
    ab.print_ratios(medians)

if __name__ == "__main__":
    main()
