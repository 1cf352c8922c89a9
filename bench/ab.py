"""A/B timing shared by the watch benchmarks: each variant is a context manager around the
same training step; rounds interleave the variants so that drift hits all of them alike."""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

Variant = Callable[[], contextlib.AbstractContextManager]


@contextlib.contextmanager
def item_hooks(model: nn.Module) -> Iterator[None]:
    """What people write first: a forward hook on every module that syncs on each statistic."""

    def hook(module, args, out):
        if isinstance(out, torch.Tensor):
            _ = (torch.isnan(out).sum().item(), torch.isinf(out).sum().item(), out.abs().max().item())

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def hf_debug(model: nn.Module) -> Iterator[None]:
    """transformers' DebugUnderflowOverflow on every module of ``model`` (it keeps no handles)."""
    from transformers.debug_utils import DebugUnderflowOverflow

    DebugUnderflowOverflow(model, max_frames_to_save=1)
    try:
        yield
    finally:
        for m in model.modules():
            m._forward_hooks.clear()


def anomaly() -> contextlib.AbstractContextManager:
    return torch.autograd.detect_anomaly(check_nan=True)


def interleaved(variants: dict[str, Variant], step: Callable[[], None], *, steps: int, rounds: int,
                warmup: int, clock: Callable[[], float] = time.perf_counter, settle: int = 0
                ) -> dict[str, tuple[float, float, float, float]]:
    """Per variant: (median seconds per step, median ratio to the baseline, and the lowest and
    highest ratio of the rounds: on a shared machine the spread says how far to trust the
    median). The first variant
    is the baseline; each round times it again right before every other variant, and a ratio
    is that pair's - so that a machine whose speed drifts within a round (a shared one) moves
    both sides of each ratio alike. ``clock``: wall time, or ``time.process_time`` (this
    process's CPU time: on a machine shared with other work, steadier than the wall clock;
    CPU only - a GPU's time is not the process's). ``settle``: steps each variant runs inside
    its context before the clock starts, so that what a variant does once (a watch's first
    step: its buffers, names, layouts) stays out of its per-step time."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()

    def timed(variant: Variant, n: int) -> float:
        with variant():
            for _ in range(settle):
                step()
            if cuda:
                torch.cuda.synchronize()
            start = clock()
            for _ in range(n):
                step()
            if cuda:
                torch.cuda.synchronize()
            return (clock() - start) / n

    warnings.filterwarnings("ignore")  # detect_anomaly warns that it is slow
    for variant in variants.values():
        timed(variant, warmup)
    (base_name, base), *others = variants.items()
    times: dict[str, list[float]] = {name: [] for name in variants}
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, variant in others:
            before = timed(base, steps)
            times[base_name].append(before)
            times[name].append(timed(variant, steps))
            ratios[name].append(times[name][-1] / before)
    ratios[base_name] = [1.0]
    return {name: (statistics.median(times[name]), statistics.median(ratios[name]), min(ratios[name]),
                   max(ratios[name])) for name in variants}


def syncs_per_step(variant: Variant, step: Callable[[], None], steps: int = 3) -> float:
    """CUDA host syncs per step under ``variant``, counted by torch's sync debug mode."""
    with variant(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught) / steps


def print_ratios(medians: dict[str, tuple[float, float, float, float]]) -> None:
    """Each variant's median time, its median ratio to the baseline and the rounds' range
    of ratios (``interleaved``)."""
    for name, (med, ratio, low, high) in medians.items():
        spread = f"  ({low:.2f}-{high:.2f}x)" if low != high else ""
        print(f"  {name:<26} {med * 1000:8.1f} ms/step  {ratio:5.2f}x{spread}")
