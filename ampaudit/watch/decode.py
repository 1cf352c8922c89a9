"""A logged step, read back (``reducer.StepValues``), as the record the summary adds up and
the log stores: Stats per (module, phase) and per parameter, the loss scale, whether the step
was skipped, and the first non-finite tensor - by name, from the step's events."""

from __future__ import annotations

from typing import Any

import torch

from ampaudit.watch import stats
from ampaudit.watch.events import INPUT_GRAD
from ampaudit.watch.layout import LAYOUT, StepBuffer
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


# a log row's fields that are floats (the rest are counts), and the exponents its histogram may hold
MAGNITUDE = [i for i, name in enumerate(LAYOUT.fields) if not LAYOUT.integer[name]]
MAGNITUDE_COLUMNS = torch.tensor(MAGNITUDE, dtype=torch.int64)
EXPONENTS = LAYOUT.exponents - 1  # exponent 255 (Inf/NaN) is not a magnitude
# per exponent e: e + 1, and EXPONENTS - e. Times "the row counts e", each row's largest of
# the two is its last exponent + 1 and EXPONENTS - its first (0: an empty row). int16: the
# 2 x N x 255 product stays small (the step boundary's ops each cost more than their elements)
_RAMPS = torch.stack([torch.arange(1, EXPONENTS + 1), torch.arange(EXPONENTS, 0, -1)]).to(torch.int16)[:, None, :]


def log_rows(rows: torch.Tensor) -> list[list]:
    """Stats rows (N x WIDTH, on the host) as log rows (``stats_merge.LOG_ROW``): the fields -
    counts as ints - then the first nonzero exponent and the counts from there to the last
    nonzero one. Cut with four torch ops over all rows, so that each row is list slicing."""
    hist = rows[:, LAYOUT.hist:LAYOUT.hist + EXPONENTS]
    stops, firsts_back = (hist.bool()[None] * _RAMPS).amax(2).tolist() if len(rows) else ([], [])
    # only the exponents some row uses are read back: a step's tensors span tens of the 255
    hi_all = max(stops, default=0)
    lo_all = EXPONENTS - max(firsts_back) if hi_all else 0
    counts = torch.cat([rows[:, :LAYOUT.hist], hist[:, lo_all:hi_all]], 1).to(torch.int64).tolist()
    magnitudes = rows.index_select(1, MAGNITUDE_COLUMNS).tolist()
    out = []
    for row, floats, stop, first_back in zip(counts, magnitudes, stops, firsts_back, strict=True):
        line = row[:LAYOUT.hist]
        for i, value in zip(MAGNITUDE, floats, strict=True):
            line[i] = value
        if stop:
            lo = EXPONENTS - first_back
            line.append(lo - 127)
            line += row[LAYOUT.hist + lo - lo_all:LAYOUT.hist + stop - lo_all]
        else:
            line.append(-127)  # no finite nonzero value: an empty run
        out.append(line)
    return out


def log_record(record: dict[str, Any], flat: torch.Tensor, buf: StepBuffer, keys: list[tuple[str, str]],
               param_keys: list[str]) -> dict[str, Any]:
    """The log line (format 2) of a step: ``record`` (what the step decided, without per-step
    rows) with the Stats rows of ``flat`` (the step's buffer, on the host) as log rows, and
    the parameters' norms and, with a GradScaler, their counts overflowing at its scale."""
    rows = log_rows(flat[buf.stats].reshape(-1, LAYOUT.width))
    layers: dict[str, dict] = {}
    for (module, phase), row in zip(keys, rows, strict=False):
        layers.setdefault(module, {})[phase] = row
    tail = flat[buf.norms.start:buf.scaled.stop].tolist()
    norms, scaled = tail[:buf.n_params], tail[buf.n_params:]
    line = {**record, "layers": layers, "params": dict(zip(param_keys, rows[buf.n_rows:], strict=True)),
            "norms": dict(zip(param_keys, norms, strict=True))}
    if any(count >= 0 for count in scaled):  # with a GradScaler
        line["overflow_at_scale"] = {name: int(count) for name, count in zip(param_keys, scaled, strict=True)}
    return line
