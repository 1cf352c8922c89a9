"""Benchmark: ampaudit.watch on a GPU - GPT-2 small, B=8, T=1024, autocast fp16 + GradScaler.

A/B interleaved in one run: a plain step; ampaudit.watch every step and every 10th step;
per-module hooks that call .item() on each statistic; torch.autograd.detect_anomaly; and,
when transformers is installed, its DebugUnderflowOverflow. Targets: watch <= 1.10x a
plain step with full stats every step, <= 1.02x with every=10.

The model is GPT2LMHeadModel from a transformers config (no weights) when transformers is
importable, else the same architecture built in code (bench/gpt2_model.py).

Run: python bench/watch_gpu.py [--steps N] [--rounds R]
     python bench/watch_gpu.py --smoke     (a 2-layer toy on the CPU: checks the script runs)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ab

import ampaudit
from ampaudit.watch import triton_stats


def build(smoke: bool, device: str):
    layers, width, vocab = (2, 96, 512) if smoke else (12, 768, 50257)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        os.environ.update(GPT2_LAYERS=str(layers), GPT2_EMBD=str(width))
        from gpt2_model import GPT

        return GPT().to(device), "GPT-2 (bench/gpt2_model.py)", False
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=4 if smoke else 12, vocab_size=vocab,
                        attn_implementation="sdpa")
    model = GPT2LMHeadModel(config).to(device)

    def loss_of(idx, targets):
        return model(input_ids=idx, labels=targets).loss

    model.loss_of = loss_of
    return model, "GPT2LMHeadModel (transformers config)", True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, 1 round of 2 steps")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("watch_gpu.py needs a CUDA GPU (use --smoke to check the script on the CPU)")
    if args.smoke:
        args.steps, args.rounds = 2, 1
    batch, seq = (2, 32) if args.smoke else (8, 1024)
    torch.manual_seed(0)
    model, name, is_hf = build(args.smoke, device)
    forward = model.loss_of if is_hf else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device)
    vocab = model.config.vocab_size if is_hf else 50257
    idx = torch.randint(0, min(vocab, 50257), (batch, seq), device=device)
    targets = torch.roll(idx, -1, 1)

    def step():
        with torch.autocast(device, dtype=torch.float16):
            loss = forward(idx, targets)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    variants = {"plain": contextlib.nullcontext,
                "watch": lambda: ampaudit.watch(model, optimizer=opt, scaler=scaler),
                "watch every=10": lambda: ampaudit.watch(model, optimizer=opt, scaler=scaler, every=10),
                "naive .item() hooks": lambda: ab.item_hooks(model), "detect_anomaly": ab.anomaly}
    if is_hf:
        variants["HF DebugUnderflowOverflow"] = lambda: ab.hf_debug(model)
    medians = ab.interleaved(variants, step, steps=args.steps, rounds=args.rounds, warmup=1 if args.smoke else 3)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{name}, B={batch}, T={seq}, autocast fp16 + GradScaler, {gpu}; rows by "
          f"{'Triton' if device == 'cuda' and triton_stats.available() else 'torch ops / C kernel'}; "
          f"median of {args.rounds} rounds x {args.steps} steps")
    ab.print_ratios(medians)
    if device == "cuda":
        plain, watched = (ab.syncs_per_step(variants[k], step) for k in ("plain", "watch"))
        print(f"host syncs per step: plain {plain:g}, watch {watched:g}")

if __name__ == "__main__":
    main()
