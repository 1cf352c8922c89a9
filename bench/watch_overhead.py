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

Run: python bench/watch_overhead.py [--workload gpt|mlp|nanogpt] [--compile] [--steps N] [--rounds R]
     [--width D] [--threads T] [--cpu-time] [--settle S]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
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


class NanoAttention(nn.Module):
    """karpathy/nanoGPT's CausalSelfAttention, shaped alike (its flash path): our own code."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.0), nn.Dropout(0.0)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d)))


class NanoBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = NanoAttention(d, heads)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(d, 4 * d), "gelu": nn.GELU(), "c_proj": nn.Linear(4 * d, d),
                                  "dropout": nn.Dropout(0.0)})

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        m = self.mlp
        return x + m["dropout"](m["c_proj"](m["gelu"](m["c_fc"](self.ln_2(x)))))


class NanoGPT(nn.Module):
    """nanoGPT's GPT in small (2 layers x 64, 4 heads, tied head, returns logits and loss)."""

    def __init__(self, vocab=65, d=64, layers=2, heads=4, ctx=64) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(vocab, d), "wpe": nn.Embedding(ctx, d),
                                          "drop": nn.Dropout(0.0),
                                          "h": nn.ModuleList([NanoBlock(d, heads) for _ in range(layers)]),
                                          "ln_f": nn.LayerNorm(d)})
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer["wte"].weight = self.lm_head.weight

    def forward(self, idx, targets):
        t = self.transformer
        x = t["drop"](t["wte"](idx) + t["wpe"](torch.arange(idx.shape[1], device=idx.device)))
        for block in t["h"]:
            x = block(x)
        logits = self.lm_head(t["ln_f"](x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=128, help="model width d (4 heads, 4 blocks)")
    parser.add_argument("--workload", choices=("gpt", "mlp", "nanogpt"), default="gpt",
                        help="gpt: TinyGPT in fp32; mlp: a small MLP, fp16 autocast and a GradScaler; nanogpt: "
                             "nanoGPT's shape, 2 layers x 64, fp32, batch 12 x 64 (issue 28 item 13)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads first (a busy shared machine: 1 "
                        "gives steadier ratios; default: torch's own)")
    parser.add_argument("--settle", type=int, default=0, help="steps each variant runs before its clock starts "
                        "(a multiple of 10 keeps every=10's recorded steps in place): the per-step cost of a "
                        "long run, without what a watch does once, at its start")
    parser.add_argument("--cpu-time", action="store_true", help="time each variant by this process's CPU time "
                        "(time.process_time) instead of the wall clock: steadier on a shared machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
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
    elif args.workload == "nanogpt":
        model = NanoGPT().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        idx = torch.randint(0, 65, (12, 64), device=device)
        targets = torch.roll(idx, -1, 1)

        def step():
            _, loss = model(idx, targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        title = "nanoGPT-shaped (2 layers x 64, batch 12 x 64), fp32"
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
                "watch, probe_loss": lambda: watched(probe_loss=True),
                "watch, torch-op rows": torch_rows, "naive .item() hooks": lambda: ab.item_hooks(model),
                "detect_anomaly": ab.anomaly}
    if args.workload == "nanogpt":  # what `ampaudit run` does: the log, every step and every 10th
        variants = {"plain": contextlib.nullcontext, "watch": watched, "watch + log": logged,
                    "watch + log, every=10": lambda: logged(every=10)}
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
    clock = time.process_time if args.cpu_time else time.perf_counter
    medians = ab.interleaved(variants, step, steps=args.steps, rounds=args.rounds, warmup=2, clock=clock,
                             settle=args.settle)
    timed_by = "process CPU time" if args.cpu_time else "wall time"
    print(f"{title}, {device}, {torch.get_num_threads()} threads, {timed_by}, "
          f"median of {args.rounds} rounds x {args.steps} steps"
          f"{f' after {args.settle} untimed' if args.settle else ''}; rows: {cpu_kernel.status()}")
    ab.print_ratios(medians)

if __name__ == "__main__":
    main()
