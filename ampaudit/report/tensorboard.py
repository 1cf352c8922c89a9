"""``ampaudit report LOG --tensorboard DIR``: a watch log's per-step numbers as TensorBoard
scalars, next to the run's own curves.

Tags, one point per logged step:
  loss_scale, skipped_step                     (with a GradScaler)
  nonfinite/<phase>/<module>                   NaN + Inf count
  overflow/<phase>/<module>, underflow/<phase>/<module>
  absmax/<phase>/<module>
  grad_norm/<param>, grad_underflow/<param>
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ampaudit.core.errors import UsageError


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """One step's record (a log line) as {tag: value}."""
    out: dict[str, float] = {}
    if record.get("scale") is not None:
        out["loss_scale"] = float(record["scale"])
        out["skipped_step"] = float(bool(record.get("skipped")))
    for module, phases in record["layers"].items():
        for phase, s in phases.items():
            out[f"nonfinite/{phase}/{module}"] = float(s["nan"] + s["inf"])
            out[f"overflow/{phase}/{module}"] = float(s["overflow"])
            out[f"underflow/{phase}/{module}"] = float(s["underflow"])
            out[f"absmax/{phase}/{module}"] = float(s["absmax"])
    for name, s in record["params"].items():
        if s.get("norm") is not None:
            out[f"grad_norm/{name}"] = float(s["norm"])
        out[f"grad_underflow/{name}"] = float(s["underflow"])
    return out


def write_tensorboard(records: Iterable[dict[str, Any]], directory: Path) -> int:
    """Write every record's scalars as one event file under ``directory`` (resolved by
    core/outputs.py: a real path, no links); returns how many points were written."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UsageError("--tensorboard needs tensorboard (pip install 'ampaudit[tensorboard]')") from None
    records = iter(records)
    first = next(records, None)
    if first is None:
        raise UsageError("the log has no finished step to write")
    points = 0
    failed: list[BaseException] = []
    saved_hook = threading.excepthook  # the writer's own thread writes: its error is ours to say, once
    threading.excepthook = lambda hook_args: failed.append(hook_args.exc_value)
    try:
        if os.path.realpath(directory) != str(directory):  # resolved at the start: a folder replaced by a link since
            raise UsageError(f"--tensorboard {directory}: a folder on its path was replaced: nothing written")
        writer = SummaryWriter(log_dir=str(directory))
        try:
            for record in itertools.chain([first], records):
                for tag, value in scalars(record).items():
                    writer.add_scalar(tag, value, global_step=record["step"])
                    points += 1
        finally:
            writer.close()
    except OSError as exc:
        failed.append(exc)
    finally:
        threading.excepthook = saved_hook
    if failed:
        cause = getattr(failed[0], "strerror", None) or failed[0]
        raise UsageError(f"cannot write TensorBoard events to {directory}: {cause}") from None
    return points
