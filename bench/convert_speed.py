"""Benchmark: training GPT-2 (built in code) in fp32, with torch.autocast + GradScaler, and
converted by ampaudit.convert - step time, peak memory and loss after N steps, one process
per variant (so peak memory is each variant's own).

On a GPU: GPT-2 small, batch 8 x 1024 tokens (not run on a GPU yet, so there are no GPU
numbers to compare with). On a CPU the model and batch shrink and the ratios are what
matters (fp16 matmuls are slow on most CPUs); docs/benchmarks.md has the CPU numbers.

Memory, two ways: the training state counted after a backward (parameters, masters,
gradients, optimizer state), and the measured peak of a whole step, per phase, from the
allocator's own records (peak_rise). Variants: fp32, autocast + GradScaler, converted (the
default for training: fx backend, weights="fp32", cast at each use), convert-modules (the
modules backend, same weights), convert-low (weights="low": stored low, fp32 masters, working
copies released during the optimizer's step), convert-kept (weights="low", release_low=False).

Run: python bench/convert_speed.py [--steps N] [--layers L] [--batch B] [--tokens T] [--optimizer adamw|sgd]
(GPT2_EMBD=384 for the CPU table in docs/benchmarks.md)
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
VARIANTS = ("fp32", "autocast", "convert", "convert-modules", "convert-low", "convert-kept")
_CONVERT_OPTIONS = {"convert": {}, "convert-modules": {"backend": "modules"}, "convert-low": {"weights": "low"},
                    "convert-kept": {"weights": "low"}}


def run_variant(variant: str, steps: int, batch: int, tokens: int, optimizer_name: str = "adamw") -> dict[str, float]:
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
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    if variant.startswith("convert"):
        model, optimizer = ampaudit.convert(model, optimizer, example_inputs=(ids[:1, :64], targets[:1, :64]),
                                            verify=False, **_CONVERT_OPTIONS[variant])
        optimizer.release_low = variant != "convert-kept"  # kept: working copies alive through the step

    def step(*, update: bool = True) -> float:
        return float(train_step(variant, lambda: model(ids, targets), optimizer, scaler, device, update=update))

    scaler = torch.amp.GradScaler(device) if variant == "autocast" else None
    for _ in range(2):  # warm-up
        step()
    optimizer.zero_grad(set_to_none=True)
    at_start = training_state_bytes(model, optimizer)["state_bytes"]  # alive when the measured step starts
    rises = peak_rise(step)
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
    step(update=False)  # gradients alive, for training_state_bytes
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"ms_per_step": statistics.median(times) * 1000, "peak_bytes": peak, "loss": loss, "device": device,
            "step_peak": at_start + rises["all"], "step_start": at_start,
            "phase_peaks": {phase: at_start + rise for phase, rise in rises.items()},
            "params_n": sum(p.numel() for p in params_of(model, optimizer)),
            **training_state_bytes(model, optimizer)}


PHASES = ("bench:forward", "bench:backward", "bench:step")
MEASURED = "bench:measured"


def train_step(variant: str, forward, optimizer, scaler, device: str, *, update: bool = True):
    """One training step of ``variant`` ("fp32", "autocast" with ``scaler``, "convert...":
    ampaudit's optimizer), each phase named (``PHASES``) for :func:`peak_rise`; ``forward()``
    returns the loss, and so does this. No gradient is alive before or after it - or, with
    ``update=False``, it stops after the backward, its gradients alive."""
    import torch
    from torch.profiler import record_function

    with record_function(PHASES[0]), torch.autocast(device, dtype=torch.float16, enabled=variant == "autocast"):
        loss = forward()
    with record_function(PHASES[1]):
        if variant == "autocast":
            scaler.scale(loss).backward()
        elif variant.startswith("convert"):
            optimizer.backward(loss)
        else:
            loss.backward()
    if not update:
        return loss
    with record_function(PHASES[2]):
        if variant == "autocast":
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def peak_rise(fn) -> dict[str, int]:
    """The highest rise of allocated bytes during ``fn()`` above what was allocated when it
    started, in each phase (a ``PHASES`` range) and in all (``"all"``): every allocation and
    free the CPU allocator reports to torch.profiler (``profile_memory``) - tensors,
    autograd's saved values, autocast's cast cache, the optimizer's temporaries - summed in
    time order. The profiler cannot size a free of memory allocated before it started, so
    ``fn`` runs twice under it and the second run is measured: what a training step frees it
    allocated in the step before. On a GPU, torch.cuda's own peak counter (``"all"`` only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    if torch.cuda.is_available():
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return {"all": torch.cuda.max_memory_allocated() - start}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
        with record_function(MEASURED):
            fn()
    events = prof.profiler.kineto_results.events()
    (begin, end), = [(e.start_ns(), e.end_ns()) for e in events if e.name() == MEASURED]
    ranges = [(e.start_ns(), e.end_ns(), e.name().split(":")[1]) for e in events
              if e.name() in PHASES and begin <= e.start_ns() <= end]
    cpu = torch._C._autograd.DeviceType.CPU
    memory = sorted((e for e in events if e.name() == "[memory]" and e.device_type() == cpu),
                    key=lambda e: e.start_ns())
    live, base, peaks = 0, None, {"all": 0}
    for e in memory:
        if e.start_ns() >= begin and base is None:
            base = live
        live += e.nbytes()
        if base is None or e.start_ns() > end:
            continue
        phase = next((name for start, stop, name in ranges if start <= e.start_ns() <= stop), "between")
        peaks[phase] = max(peaks.get(phase, 0), live - base)
        peaks["all"] = max(peaks["all"], live - base)
    return peaks


def params_of(model, optimizer) -> list:
    """The model's parameters, each once (the count behind bytes per parameter)."""
    seen, out = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


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
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="sgd: momentum 0.9")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in a child process
    args = parser.parse_args()
    import torch

    gpu = torch.cuda.is_available()
    steps = args.steps or (20 if gpu else 3)
    batch = args.batch or (8 if gpu else 2)
    tokens = args.tokens or (1024 if gpu else 64)
    if args.variant:
        print(json.dumps(run_variant(args.variant, steps, batch, tokens, args.optimizer)))
        return
    env = dict(os.environ)
    env.setdefault("GPT2_LAYERS", str(args.layers or (12 if gpu else 2)))
    results = {}
    for variant in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--variant", variant, "--steps", str(steps), "--batch",
                               str(batch), "--tokens", str(tokens), "--optimizer", args.optimizer], env=env,
                              capture_output=True, text=True, check=True)
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    device = results["fp32"]["device"]
    n = results["fp32"]["params_n"]
    print(f"GPT-2 ({env['GPT2_LAYERS']} layers, {n / 1e6:.1f}M parameters), batch {batch} x {tokens} tokens, "
          f"{steps} timed steps, {device}, {args.optimizer}")
    print(f"  {'variant':<16} {'ms/step':>9} {'x autocast':>10} {'peak RSS':>9} {'loss':>9}")
    base = results["autocast"]["ms_per_step"]
    for variant, r in results.items():
        print(f"  {variant:<16} {r['ms_per_step']:9.1f} {r['ms_per_step'] / base:10.2f} "
              f"{r['peak_bytes'] / 2**30:5.2f} GiB {r['loss']:9.4f}")
    print("Training state right after a backward, counted (each tensor once), and the measured peak of one "
          f"step ({'torch.cuda max_memory_allocated' if device == 'cuda' else 'the CPU allocator, via torch.profiler'}"
          "; zero_grad first, the peak per phase):")
    print(f"  {'variant':<16} {'params':>7} {'masters':>7} {'grads':>7} {'opt st':>7} {'counted':>7} {'x ac':>6} "
          f"{'B/p':>5} | {'forward':>7} {'backwd':>7} {'step':>7} {'peak':>7} {'x ac':>6} {'B/p':>5}")
    mib = 2**20
    base_state, base_peak = results["autocast"]["state_bytes"], results["autocast"]["step_peak"]
    for variant, r in results.items():
        phases = r["phase_peaks"]
        shown = " ".join(f"{phases[p] / mib:7.1f}" if p in phases else f"{'-':>7}" for p in ("forward", "backward",
                                                                                           "step"))
        print(f"  {variant:<16} {r['params'] / mib:7.1f} {r['masters'] / mib:7.1f} {r['grads'] / mib:7.1f} "
              f"{r['state'] / mib:7.1f} {r['state_bytes'] / mib:7.1f} {r['state_bytes'] / base_state:6.3f} "
              f"{r['state_bytes'] / n:5.2f} | {shown} {r['step_peak'] / mib:7.1f} "
              f"{r['step_peak'] / base_peak:6.3f} {r['step_peak'] / n:5.2f}")
    print("  (MiB; x ac: x autocast; B/p: bytes per parameter; a phase's peak is what the step started with plus the"
          " allocator's highest rise in it)")


if __name__ == "__main__":
    main()
