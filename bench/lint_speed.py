"""Benchmark: the training-script lint on a generated corpus of realistic scripts.

Writes N training scripts (~300 lines each: config, dataset, model, an AMP training loop with
a random mix of correct and buggy steps, evaluation, checkpointing, logging) to a temporary
folder, then times `ampaudit check --lint-only FOLDER` in one process and on all cores.

Run: python bench/lint_speed.py [--files 500]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ampaudit.check.options import CheckOptions
from ampaudit.check.run import check_targets
from ampaudit.core.config import Config

HEADER = '''"""Training script {i}: {task} on synthetic data."""

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
{amp_import}
from torch.utils.data import DataLoader, Dataset


@dataclass
class Config:
    epochs: int = {epochs}
    batch_size: int = {batch}
    lr: float = {lr}
    weight_decay: float = 0.01
    hidden: int = {hidden}
    layers: int = {layers}
    dropout: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 50
    out_dir: str = "runs/{task}"
    seed: int = {i}
    tags: list = field(default_factory=list)


def parse_args() -> Config:
    parser = argparse.ArgumentParser(description="{task}")
    parser.add_argument("--epochs", type=int, default={epochs})
    parser.add_argument("--batch-size", type=int, default={batch})
    parser.add_argument("--lr", type=float, default={lr})
    parser.add_argument("--hidden", type=int, default={hidden})
    parser.add_argument("--out-dir", default="runs/{task}")
    args = parser.parse_args()
    return Config(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, hidden=args.hidden,
                  out_dir=args.out_dir)


class SyntheticDataset(Dataset):
    def __init__(self, size: int, features: int, classes: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, features, generator=generator)
        self.y = torch.randint(0, classes, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]
'''

MODEL = '''

class Block{k}(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, {mult} * dim)
        self.fc2 = nn.Linear({mult} * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(self.drop(F.gelu(self.fc1(self.norm(x)))))
        return x + self.drop(h)
'''

NET = '''

class Net(nn.Module):
    def __init__(self, features: int, classes: int, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Linear(features, cfg.hidden)
        self.blocks = nn.ModuleList([{blocks}])
        self.head = nn.Linear(cfg.hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build(cfg: Config, features: int, classes: int):
    model = Net(features, classes, cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs * 100)
    return model, optimizer, scheduler
'''

TRAIN = '''

def train_epoch(model, loader, optimizer, scheduler, scaler, cfg: Config, device: str) -> float:
    model.train()
    total, count = 0.0, 0
    for step, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        with {autocast}:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
{backward}
{clip}
{step}
        scheduler.step()
        total += loss.item() * len(x)
        count += len(x)
        if step % cfg.log_every == 0:
            print(json.dumps({{"step": step, "loss": loss.item(), "lr": scheduler.get_last_lr()[0]}}))
    return total / max(count, 1)
'''

TAIL = '''

@torch.no_grad()
def evaluate(model, loader, device: str) -> dict:
    model.eval()
    correct, seen, loss_sum = 0, 0, 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        seen += len(y)
    return {{"loss": loss_sum / max(seen, 1), "accuracy": correct / max(seen, 1)}}


def save_checkpoint(path: str, model, optimizer, epoch: int, metrics: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save({{"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                "metrics": metrics}}, path)


def load_checkpoint(path: str, model, optimizer) -> int:
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["epoch"] + 1


def warmup_lr(step: int, warmup: int, base: float) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, 10_000 - warmup)
    return base * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def main() -> None:
    cfg = parse_args()
    torch.manual_seed(cfg.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train_set = SyntheticDataset(4096, 64, 10, seed=cfg.seed)
    valid_set = SyntheticDataset(512, 64, 10, seed=cfg.seed + 1)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, drop_last=True)
    valid_loader = DataLoader(valid_set, batch_size=cfg.batch_size)
    model, optimizer, scheduler = build(cfg, 64, 10)
    model = model.to(device)
    scaler = {scaler}
    start = load_checkpoint(os.path.join(cfg.out_dir, "last.pt"), model, optimizer)
    print(f"parameters: {{count_parameters(model):,}}")
    for epoch in range(start, cfg.epochs):
        began = time.time()
        train_loss = train_epoch(model, train_loader, optimizer, scheduler, scaler, cfg, device)
        metrics = evaluate(model, valid_loader, device)
        metrics.update(train_loss=train_loss, seconds=time.time() - began)
        print(json.dumps({{"epoch": epoch, **metrics}}))
        save_checkpoint(os.path.join(cfg.out_dir, "last.pt"), model, optimizer, epoch, metrics)


if __name__ == "__main__":
    main()
'''

VARIANTS = {
    "autocast": ['torch.autocast(device_type=device, dtype=torch.float16)', 'torch.autocast("cuda")',
                 'torch.cuda.amp.autocast()', 'autocast(dtype=torch.bfloat16)'],
    "backward": ["        scaler.scale(loss).backward()", "        loss.backward()",
                 "        scaler.scale(loss).backward()"],
    "clip": ["        scaler.unscale_(optimizer)\n        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)",
             "        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)", ""],
    "step": ["        scaler.step(optimizer)\n        scaler.update()", "        optimizer.step()",
             "        scaler.step(optimizer)"],
    "scaler": ['torch.amp.GradScaler("cuda")', "torch.cuda.amp.GradScaler()", "GradScaler()"],
    "amp_import": ["from torch.cuda.amp import GradScaler, autocast", "from torch.amp import GradScaler, autocast"],
}


def script(i: int, rng: random.Random) -> str:
    pick = {k: rng.choice(v) for k, v in VARIANTS.items()}
    blocks = rng.randint(6, 10)
    task = rng.choice(["classification", "regression", "probing"])
    text = HEADER.format(i=i, task=task, amp_import=pick["amp_import"],
                         epochs=rng.randint(1, 20), batch=rng.choice([32, 64, 128]), lr=rng.choice([1e-3, 3e-4]),
                         hidden=rng.choice([128, 256]), layers=blocks)
    text += "".join(MODEL.format(k=k, mult=rng.choice([2, 4])) for k in range(blocks))
    text += NET.format(blocks=", ".join(f"Block{k}(cfg.hidden, cfg.dropout)" for k in range(blocks)))
    text += TRAIN.format(**pick)
    text += TAIL.format(scaler=pick["scaler"])
    return text


def write_corpus(folder: Path, count: int) -> int:
    rng = random.Random(0)
    lines = 0
    for i in range(count):
        text = script(i, rng)
        lines += text.count("\n")
        (folder / f"train_{i:04d}.py").write_text(text)
    return lines


def timed(folder: Path, jobs: int) -> tuple[float, int]:
    start = time.perf_counter()
    report = check_targets([str(folder)], Config(), CheckOptions(lint_only=True, jobs=jobs))
    return time.perf_counter() - start, len(report.findings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        lines = write_corpus(folder, args.files)
        cores = os.cpu_count() or 1
        one, found = timed(folder, 1)
        many, found_many = timed(folder, cores)
        assert found == found_many
        print(f"{args.files} scripts, {lines / args.files:.0f} lines each on average, {found} findings")
        print(f"  1 process : {one:6.2f} s  {args.files / one:7.1f} files/s")
        print(f"  {cores} processes: {many:6.2f} s  {args.files / many:7.1f} files/s  ({one / many:.2f}x)")


if __name__ == "__main__":
    main()
