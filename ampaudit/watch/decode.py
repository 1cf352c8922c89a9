"""A logged step, read back (``reducer.StepValues``), as the record the summary adds up and
the log stores: Stats per (module, phase) and per parameter, the loss scale, whether the step
was skipped, and the first non-finite tensor - by name, from the step's events."""

from __future__ import annotations

from typing import Any

from ampaudit.watch import stats
from ampaudit.watch.hooks import INPUT_GRAD
from ampaudit.watch.reducer import NO_EVENT, StepValues


def step_record(step: int, values: StepValues, keys: list[tuple[str, str]], param_keys: list[str],
                events: list[tuple[str, str, str]], *, world: int, skipped: bool | None,
                context: dict[str, Any]) -> dict[str, Any]:
    """The record of logged step ``step``: ``keys`` name the (module, phase) rows, ``events``
    the (module, phase, tensor) of each event in order; ``skipped`` is used when no
    GradScaler says; ``context`` (the dtype, tensors not measured, ...) ends the record."""
    layers: dict[str, dict] = {}
    for (module, phase), row in zip(keys, values.layers, strict=False):
        layers.setdefault(module, {})[phase] = stats.to_stats(row)
    params: dict[str, dict] = {}
    for i, name in enumerate(param_keys if values.params is not None else []):
        entry = stats.to_stats(values.params[i])
        entry["norm"] = values.norms[i]
        if values.scaled[i] >= 0:
            entry["overflow_at_scale"] = int(values.scaled[i])
        params[name] = entry
    nonfinite_params = [name for name, bad in zip(param_keys, values.param_nonfinite, strict=True) if bad]
    first_seq, rank = values.first, 0
    if world > 1:  # the reducer packed it as sequence * world + rank
        first_seq, rank = divmod(int(first_seq), world)
    first = None
    if first_seq < NO_EVENT and int(first_seq) < len(events):
        module, phase, tensor = events[int(first_seq)]
        first = {"step": step, "module": module, "phase": "backward" if phase == INPUT_GRAD else phase,
                 "tensor": tensor}
        if world > 1:
            first["rank"] = rank
    elif nonfinite_params:
        first = {"step": step, "module": nonfinite_params[0], "phase": "backward", "tensor": "param grad"}
    found_inf = values.found_inf
    was_skipped = bool(found_inf > 0) if found_inf >= 0 else bool(skipped)
    return {"step": step, "steps_seen": step + 1, "layers": layers, "params": params,
            "scale": values.scale if values.scale >= 0 else None, "skipped": was_skipped,
            "first_nonfinite": first, "nonfinite_params": nonfinite_params if was_skipped else [], **context}
