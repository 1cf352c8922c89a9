"""``ampaudit report --plot``: gradient-magnitude histograms and overflow/underflow over
steps, drawn with matplotlib from a watch log."""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ampaudit.core.errors import UsageError
from ampaudit.core.outputs import Output, write_output

PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".eps", ".ps")


def check_plot_path(path: Path) -> None:
    """Before reading a log: the suffix names the image format."""
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot {path}: name an image file ({', '.join(PLOT_SUFFIXES[:3])}, ...)")


def plot(records: Iterable[dict[str, Any]], summary: dict[str, Any], output: Output) -> None:
    """Draw the plot in memory, then write it whole (an earlier plot is never left truncated)."""
    """Per-layer gradient-magnitude histograms and overflow/underflow over steps (matplotlib).
    ``records`` are streamed: only three numbers per step are kept."""
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
    steps: list[int] = []
    over: list[int] = []
    under: list[int] = []
    for record in records:
        steps.append(record["step"])
        over.append(sum(ph.get("overflow", 0) for m in record["layers"].values() for ph in m.values()))
        under.append(sum(ph.get("underflow", 0) for m in record["layers"].values() for ph in m.values()))
    bottom.plot(steps, over, label="overflow")
    bottom.plot(steps, under, label="underflow")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    image = io.BytesIO()
    try:
        fig.savefig(image, format=output.path.suffix[1:].lower())
    finally:
        plt.close(fig)
    write_output(output, image.getvalue())
