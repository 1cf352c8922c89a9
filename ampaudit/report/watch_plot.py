"""``ampaudit report --plot``: gradient-magnitude histograms and overflow/underflow over
steps, drawn with matplotlib from a watch log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ampaudit.core.errors import UsageError


def plot(records: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    """Per-layer gradient-magnitude histograms and overflow/underflow over steps (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib (pip install 'ampaudit[plot]')") from None
    grads = [(m, p["backward"]) for m, p in summary["layers"].items() if "backward" in p]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8))
    for module, s in grads[:12]:
        if s["hist"]:
            exps, counts = zip(*s["hist"], strict=True)
            top.plot(exps, counts, label=module)
    top.set_xlabel("log2 |gradient|")
    top.set_ylabel("count")
    top.set_yscale("log")
    top.legend(fontsize="small")
    steps = [r["step"] for r in records]
    over = [sum(ph.get("overflow", 0) for m in r["layers"].values() for ph in m.values()) for r in records]
    under = [sum(ph.get("underflow", 0) for m in r["layers"].values() for ph in m.values()) for r in records]
    bottom.plot(steps, over, label="overflow")
    bottom.plot(steps, under, label="underflow")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise UsageError(f"cannot write the plot to {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
