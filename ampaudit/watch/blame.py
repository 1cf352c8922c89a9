"""The step's first non-finite value, traced to where it was born.

The device finds the first event whose tensor held NaN or +inf (``reducer``); that is where
a forward NaN was born, but in backward it is where a bad gradient *arrived*: a tensor hook
on a module's output sees the gradient its consumer's backward made. So on such a step only,
the events' flags are read back (one more host sync) and the producer is the innermost module
whose incoming gradients were finite and whose input gradients are not (``blame_backward``).
Then the module is replayed (``provenance``) to name the op or autograd node and its line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ampaudit.watch import stats
from ampaudit.watch.hooks import INPUT_GRAD, StepRecorder
from ampaudit.watch.provenance import Call, GradSpec, replay_backward, replay_forward

_BACKWARD = ("backward", INPUT_GRAD)


def trace_first(first: dict[str, Any], seq: int, recorder: StepRecorder,
                nonfinite_params: Sequence[str]) -> dict[str, Any]:
    """``first`` (the record's first_nonfinite, event ``seq`` of the step) with the module that
    made it, and the op (``op``, ``source``) or why it is unknown (``note``). The recorder is
    paused meanwhile: the replays run the user's modules, and that is not the run's data."""
    recorder.paused = True
    try:
        return _trace(first, seq, recorder, nonfinite_params)
    finally:
        recorder.paused = False


def _trace(first: dict[str, Any], seq: int, recorder: StepRecorder, nonfinite_params: Sequence[str]) -> dict[str, Any]:
    phase = recorder.events[seq][1]
    if phase == "forward":
        call = _call(recorder, recorder.event_calls[seq])
        if call is None:
            return {**first, "note": "the call was released before the step ended"}
        return {**first, **replay_forward(call).to_dict()}
    if phase not in _BACKWARD:
        return first
    device = recorder.event_rows[0][0]
    raw = stats.raw_matrix(*recorder.arena.matrix(recorder.event_rows, device))
    bad = stats.harmful(raw).tolist()  # a second host sync, on this step only
    events = [Event(m, p, t, c) for (m, p, t), c in zip(recorder.events, recorder.event_calls, strict=True)]
    fallback = None
    for index in blame_backward(events, bad):
        event, call = events[index], _call(recorder, events[index].call)
        origin = replay_backward(call, _incoming(events, raw, event.call, recorder)) if call else None
        found = {"step": first["step"], "module": event.module, "phase": "backward", "tensor": event.tensor}
        if origin is not None and origin.op is not None:
            return {**found, **origin.to_dict()}
        fallback = fallback or {**found, **(origin.to_dict() if origin else {"note": "the call was released"})}
    if fallback is not None:
        return fallback
    param = blame_parameter(events, bad, nonfinite_params)
    if param is not None:
        owner, _, name = param.rpartition(".")
        return {"step": first["step"], "module": owner or "(model)", "phase": "backward", "tensor": f"grad of {name}"}
    return {**first, "phase": "backward"}  # it came in from outside the modules (the loss)


def _call(recorder: StepRecorder, index: int | None) -> Call | None:
    return recorder.calls[index] if index is not None and index < len(recorder.calls) else None


def _incoming(events: list[Event], raw: torch.Tensor, call: int | None, recorder: StepRecorder) -> list[GradSpec]:
    """What the step recorded of the gradients that came into ``call``'s outputs."""
    specs = []
    for i, event in enumerate(events):
        if event.call == call and event.phase == "backward" and event.tensor.startswith("grad of output"):
            row = stats.to_stats(stats.compact(raw[i:i + 1], recorder.limits)[0].tolist())
            output = int(event.tensor.rpartition("[")[2].rstrip("]")) if "[" in event.tensor else 0
            specs.append(GradSpec(output, row["hist"], row["zero"]))
    return specs


@dataclass(frozen=True)
class Event:
    """One recorded tensor of the step: whose, which phase, which tensor, which call."""

    module: str
    phase: str
    tensor: str
    call: int | None = None


def blame_backward(events: Sequence[Event], bad: Sequence[bool]) -> list[int]:
    """Where a non-finite gradient may have been born, most likely first: the events "grad of
    input k" that are bad, of modules whose incoming gradients (of their outputs) were all
    finite - innermost modules first, their parents after (a tensor hook sees the whole
    gradient of an input, which other users of that tensor add to: the replay decides).
    Empty when every bad gradient came in from outside the modules (the loss)."""
    out_bad: dict[str, bool] = {}
    first_in: dict[str, int] = {}
    for i, (event, is_bad) in enumerate(zip(events, bad, strict=True)):
        if event.phase not in _BACKWARD:
            continue
        if event.tensor.startswith("grad of output"):
            out_bad[event.module] = out_bad.get(event.module, False) or is_bad
        elif is_bad and event.tensor.startswith("grad of input"):
            first_in.setdefault(event.module, i)
    candidates = [m for m in first_in if not out_bad.get(m, False)]

    def inside(inner: str) -> int:  # how many other candidates lie inside this one
        return sum(_contains(inner, other) for other in candidates)

    return [first_in[m] for m in sorted(candidates, key=lambda m: (inside(m), first_in[m]))]


def blame_parameter(events: Sequence[Event], bad: Sequence[bool], bad_params: Sequence[str]) -> str | None:
    """A parameter whose gradient went non-finite in a module whose incoming gradients were
    all finite (no input of it needed a gradient to show it): where it was born, or None."""
    out_bad: dict[str, bool] = {}
    for event, is_bad in zip(events, bad, strict=True):
        if event.phase in _BACKWARD and event.tensor.startswith("grad of output"):
            out_bad[event.module] = out_bad.get(event.module, False) or is_bad
    for name in bad_params:
        owner = name.rpartition(".")[0] or "(model)"
        if out_bad.get(owner) is False:
            return name
    return None


def _contains(outer: str, inner: str) -> bool:
    return outer != inner and (outer == "(model)" or inner.startswith(outer + "."))
