"""The step's first non-finite value, traced to where it was born.

The device finds the first event whose tensor held NaN or +inf (``reducer``); that is where
a forward NaN was born, but in backward it is where a bad gradient *arrived*: a tensor hook
on a module's output sees the gradient its consumer's backward made. So on such a step only,
the events' flags are read back (one more host sync) and the producer is the innermost module
whose incoming gradients were finite and whose input gradients are not (``blame_backward``).
Then the module is replayed (``provenance``) to name the op or autograd node and its line.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ampaudit.watch import stats
from ampaudit.watch.events import INPUT_GRAD, LOSS
from ampaudit.watch.hooks import COMPILED, EARLIER, StepRecorder
from ampaudit.watch.loss_notes import FROM_THE_LOSS, LOSS_ALONE, LOSS_ITSELF, LOSS_SCALED, LOSS_SPREAD, double_backward
from ampaudit.watch.provenance import Call, GradSpec, call_site, replay_backward, replay_forward
from ampaudit.watch.reducer import ANY, HARMFUL, IGNORED

_BACKWARD = ("backward", INPUT_GRAD)


def trace_first(first: dict[str, Any], seq: int, recorder: StepRecorder, nonfinite_params: Sequence[str],
                modes: list[int], masks: set[str], scaled: bool = False) -> dict[str, Any] | None:
    """``first`` (the record's first_nonfinite, event ``seq`` of the step) with the module that
    made it, and the op (``op``, ``source``) or why it is unknown (``note``); None when it was
    only -inf a module writes on purpose (added to ``masks``) and nothing else went bad. The
    recorder is paused meanwhile: the replays run the user's modules, not the run's data.
    ``scaled``: the step's loss was scaled (a GradScaler), which a note may name as a cause."""
    with _paused(recorder):
        return _Trace(recorder, modes, masks, scaled).first(first, seq, nonfinite_params)


def trace_parameter(first: dict[str, Any], recorder: StepRecorder, nonfinite_params: Sequence[str]) -> dict[str, Any]:
    """Only a parameter's gradient went non-finite: the module holding it (each, for a tied
    weight) is replayed; the one whose backward makes it non-finite is named, with the node."""
    with _paused(recorder):
        trace = _Trace(recorder, [], set())
        cleared = False
        for name in nonfinite_params:
            for owner in recorder.param_owners(name):
                for index in trace.calls_of(owner):
                    origin = replay_backward(recorder.calls[index], trace.incoming(index))
                    if origin.op is not None:
                        return {"step": first["step"], "module": owner, "phase": "backward",
                                "tensor": f"grad of {name.rpartition('.')[2]}", **origin.to_dict()}
                    cleared = cleared or origin.cleared
        if cleared and "note" not in first:  # its module's gradients finite, and its backward's too
            return {**first, "note": "replayed, the backward of the module that holds it made no NaN or Inf: it "
                                     "went non-finite after the backward, in code that writes the gradients (a "
                                     "division, clipping, a hook), or from exact gradient values a replay does "
                                     "not have"}
        return first


@contextmanager
def _paused(recorder: StepRecorder) -> Iterator[None]:
    """The replays run the user's modules: what the hooks would see is not the run's data."""
    recorder.paused = True
    try:
        yield
    finally:
        recorder.paused = False


class _Trace:
    """One step's events, their flags (read back once, when needed) and the replays."""

    def __init__(self, recorder: StepRecorder, modes: list[int], masks: set[str], scaled: bool = False) -> None:
        self.recorder, self.modes, self.masks, self.scaled = recorder, modes, masks, scaled
        self.events = [Event(m, p, t, c) for (m, p, t), c in zip(recorder.events, recorder.event_calls, strict=True)]
        self._raw: torch.Tensor | None = None
        self._flags: tuple[list[bool], list[bool]] | None = None

    @property
    def raw(self) -> torch.Tensor:
        if self._raw is None:
            rows = self.recorder.event_rows
            device = rows[0][0] if rows else torch.device("cpu")
            self._raw = stats.raw_matrix(*self.recorder.arena.matrix(rows, device))
        return self._raw

    def flags(self) -> tuple[list[bool], list[bool]]:
        """Per event: held NaN/+inf, held any non-finite (a second host sync, on this step only)."""
        if self._flags is None:
            self._flags = stats.harmful(self.raw).tolist(), stats.nonfinite(self.raw).tolist()
        return self._flags

    def bad(self) -> list[bool]:
        harmful, nonfinite = self.flags()
        return [(mode >= HARMFUL and h) or (mode == ANY and n)
                for mode, h, n in zip(self.modes, harmful, nonfinite, strict=True)]

    def first(self, first: dict[str, Any], seq: int, nonfinite_params: Sequence[str]) -> dict[str, Any] | None:
        while True:
            event = self.events[seq]
            if event.phase == "forward":
                found = self.forward(first, seq)
                if found is not None:
                    return found
                # -inf that the module writes on purpose (a mask): the next candidate, if any
                self.masks.add(event.module)
                self.modes = [HARMFUL if e.module == event.module and e.phase == "forward" and m == ANY else m
                              for e, m in zip(self.events, self.modes, strict=True)]
                seq = next((i for i, bad in enumerate(self.bad()) if bad and i > seq), None)
                if seq is None:
                    if nonfinite_params:  # only a parameter's gradient went bad: this step, not the next
                        return trace_parameter({"step": first["step"], "module": nonfinite_params[0],
                                                "phase": "backward", "tensor": "param grad"},
                                               self.recorder, nonfinite_params)
                    return None
                nxt = self.events[seq]
                first = {"step": first["step"], "module": nxt.module, "tensor": nxt.tensor,
                         "phase": "backward" if nxt.phase == INPUT_GRAD else nxt.phase}
                continue
            if event.phase in _BACKWARD:
                return self.backward(first, nonfinite_params)
            if event.phase == LOSS:  # made by the loop's code: the loss probe may name it (``loss_probe``)
                later = any(bad for bad in self.bad()[seq + 1:]) or bool(nonfinite_params)
                lead = LOSS_SCALED if self.scaled else LOSS_ITSELF
                return {**first, "note": lead + (LOSS_SPREAD if later else LOSS_ALONE), "made_in": "loss"}
            return first

    def forward(self, first: dict[str, Any], seq: int) -> dict[str, Any] | None:
        """The op that made the forward event ``seq`` non-finite; None for a -inf mask."""
        event = self.events[seq]
        index = event.call
        call = self.call(index)
        if call is None:
            return {**first, "note": _no_replay(index)}
        origin = replay_forward(call)
        # -inf only, and neither arithmetic, a non-finite weight nor a bad input made it: a mask
        if origin.op is None and origin.state is None and not origin.outside and not self.flags()[0][seq]:
            return None
        # made before this module: by an enclosing module's own code? (not if an ignored one made it)
        if origin.outside and not any(m == IGNORED and n for m, n in zip(self.modes, self.flags()[1], strict=True)):
            unfound = None  # the innermost enclosing module whose inputs were finite: its own code made it
            for parent in self.enclosing(index):
                found = replay_forward(self.recorder.calls[parent])
                name = self.recorder.module_name(self.recorder.calls[parent].module)
                if found.op is not None:
                    return {"step": first["step"], "module": name, "phase": "forward", "tensor": "output",
                            **found.to_dict()}
                if unfound is None and not found.outside and found.state is None:
                    unfound = name
            if unfound is not None:  # not "from outside the watched modules": they were finite coming in
                return {"step": first["step"], "module": unfound, "phase": "forward", "tensor": "output",
                        "note": f"`{event.module}`'s inputs already held NaN or +inf, made by `{unfound}`'s own code "
                                "(its inputs were finite), which stayed finite when replayed: it depends on state, "
                                "random numbers or inputs changed in place since"}
        # NaN made of a -inf that came in: a -inf an enclosing module's own code made by arithmetic
        # (a log of 0 after a ReLU: Pytorch-UNet's head) was born there, not in this module
        if origin.masked_input:
            for parent in self.enclosing(index):
                found = replay_forward(self.recorder.calls[parent]).minus_inf
                if found is not None:
                    name = self.recorder.module_name(self.recorder.calls[parent].module)
                    found.note = (f"it made -inf by arithmetic (not a mask, which masked_fill/where would write), "
                                  f"which `{event.module}` turned into NaN or Inf")
                    return {"step": first["step"], "module": name, "phase": "forward", "tensor": "output",
                            **found.to_dict()}
        return self.located({**first, **origin.to_dict()}, index)

    def backward(self, first: dict[str, Any], nonfinite_params: Sequence[str]) -> dict[str, Any]:
        fallback = shared = None
        for index in blame_backward(self.events, self.bad()):
            event, call = self.events[index], self.call(self.events[index].call)
            origin = replay_backward(call, self.incoming(event.call)) if call else None
            found = {"step": first["step"], "module": event.module, "phase": "backward", "tensor": event.tensor}
            if origin is not None and origin.op is not None:
                return self.located({**found, **origin.to_dict()}, event.call)
            if origin is not None and origin.cleared and shared is None:
                shared = self.also_output(index)
            fallback = fallback or {**found, **(origin.to_dict() if origin else {"note": _no_replay(event.call)})}
        found = self.enclosing_code(first)
        if found is not None and found.get("op") is not None:
            return found
        if self.recorder.graph_grads:  # a penalty's backward brought it: the loss code's, which the probe replays
            return {**first, "phase": "backward", "note": double_backward(self.recorder.graph_grads[0]),
                    "made_in": "loss"}
        if found is not None:
            return found
        if shared is not None:  # its replay clears the module: the output's other users made it
            user, output = shared
            return {"step": first["step"], "module": output.module, "phase": "backward", "tensor": output.tensor,
                    "note": f"it came into `{output.module}`'s output already non-finite, from code outside the "
                            "watched modules that uses that output (a term of the loss, say): "
                            f"`{user}`, which uses it too, made no NaN or Inf when its backward was replayed"}
        if fallback is not None:
            return fallback
        param = blame_parameter(self.events, self.bad(), nonfinite_params)
        if param is not None:
            return trace_parameter(first, self.recorder, [param])
        if any(bad and event.call == EARLIER for event, bad in zip(self.events, self.bad(), strict=True)):
            return {**first, "phase": "backward", "note": _no_replay(EARLIER)}  # its enclosing calls unknown here
        # the likely cause named is one this run can have: no loss scale without a GradScaler
        example = "a loss scale too high for a cast of the logits" if self.scaled else \
            "a log of 0 or a division by 0 in the loss"
        return {**first, "phase": "backward", "note": f"{FROM_THE_LOSS} ({example}, say)", "made_in": "loss"}

    def also_output(self, index: int) -> tuple[str, Event] | None:
        """Where the bad input gradient ``index`` is also the gradient of another module's
        output (one tensor, one hook, one row: ``StepRecorder.hook_grad``), which every user of
        that output adds to: (the input's module, that output's event), or None."""
        rows, user = self.recorder.event_rows, self.events[index].module
        outputs = [event for j, (event, is_bad) in enumerate(zip(self.events, self.bad(), strict=True))
                   if j != index and is_bad and rows[j] is rows[index] and event.phase == "backward"
                   and event.tensor.startswith("grad of output") and event.module != user
                   and not _contains(user, event.module)]
        # a container returns its last child's very tensor: named as the outermost module's output
        outer = [e for e in outputs if not any(_contains(o.module, e.module) for o in outputs)]
        return (user, outer[0]) if outer else None

    def enclosing_code(self, first: dict[str, Any]) -> dict[str, Any] | None:
        """A bad gradient that arrived at a module's output from finite gradients further on was
        made between modules: in the code of a module enclosing it (a custom Function applied in
        the model's own forward). Those modules are replayed, innermost first; None if none
        turns finite gradients non-finite."""
        bad = self.bad()
        arrived = next((e for e, b in zip(self.events, bad, strict=True)
                        if b and e.phase == "backward" and e.tensor.startswith("grad of output")), None)
        if arrived is None:
            return None
        unfound, bad_output = None, False  # the innermost module whose code made it, its replay finite
        for parent in self.enclosing(arrived.call):
            call = self.recorder.calls[parent]
            incoming = self.incoming(parent)
            if not incoming or all(spec.bad for spec in incoming):
                continue  # only bad gradients came into it (from the loss): not made in its code
            # an output whose gradient is bad beside finite ones (logits beside the loss a
            # transformers model computes from them) got it from inside: replayed from zero
            origin = replay_backward(call, incoming)
            if origin.op is not None:
                return {"step": first["step"], "module": self.recorder.module_name(call.module), "phase": "backward",
                        "tensor": f"grad of {arrived.module}'s output", **origin.to_dict()}
            if unfound is None:
                unfound = self.recorder.module_name(call.module)
                bad_output = any(spec.bad for spec in incoming)
        if unfound is not None and bad_output:  # an output's gradient came in bad beside finite ones
            return {**first, "note": f"it came into `{unfound}`'s output already non-finite: from code outside the "
                                     "watched modules that uses that output (a term of the loss, say), or from "
                                     f"`{unfound}`'s own code after it, which stayed finite when replayed from the "
                                     "other outputs' gradients"}
        if unfound is not None:  # not from the loss: finite gradients came into that module
            return {**first, "note": f"it was made between modules, in the code of `{unfound}`'s forward (the "
                                     "gradients that came into it were finite); replayed with gradients shaped like "
                                     "the recorded ones that code stayed finite, so the op is not known (it depends on "
                                     "their exact values, or on state)"}
        return None

    def located(self, found: dict[str, Any], index: int | None) -> dict[str, Any]:
        """``found`` with the user's line that called its module, when the op's own line is not
        the user's (an op inside nn.Linear): the enclosing module is replayed to find it."""
        call = self.call(index)
        if found.get("op") is None or found.get("source") or call is None:
            return found
        for parent in self.enclosing(index):
            outer = self.recorder.calls[parent]
            earlier = [i for i in range(index) if self.recorder.calls[i] is not None
                       and self.recorder.calls[i].module is outer.module]
            start = earlier[-1] if earlier else -1  # the parent's call before this one
            nth = sum(1 for i in range(start + 1, index) if self.recorder.calls[i] is not None
                      and self.recorder.calls[i].module is call.module)
            site = call_site(outer, call.module, nth)
            if site is not None:
                return {**found, "source": f"{site[0]}:{site[1]}"}
        return found

    def call(self, index: int | None) -> Call | None:
        calls = self.recorder.calls
        return calls[index] if index is not None and 0 <= index < len(calls) else None

    def calls_of(self, module: str) -> list[int]:
        return [i for i, call in enumerate(self.recorder.calls)
                if call is not None and self.recorder.module_name(call.module) == module]

    def enclosing(self, index: int | None) -> list[int]:
        """The calls of the modules enclosing call ``index``, innermost first: a forward hook
        runs when a module returns, so an enclosing module's call comes after its children's."""
        if index is None or self.call(index) is None:
            return []
        name = self.recorder.module_name(self.recorder.calls[index].module) or ""
        found, seen = [], set()
        for later in range(index + 1, len(self.recorder.calls)):
            call = self.recorder.calls[later]
            outer = self.recorder.module_name(call.module) if call is not None else None
            if outer is not None and outer not in seen and _contains(outer, name):
                found.append(later)
                seen.add(outer)
        return found

    def incoming(self, call: int | None) -> list[GradSpec]:
        """What the step recorded of the gradients that came into ``call``'s outputs."""
        specs = []
        for i, event in enumerate(self.events):
            if event.call == call and event.phase == "backward" and event.tensor.startswith("grad of output"):
                row = stats.to_stats(stats.compact(self.raw[i:i + 1], self.recorder.limits)[0].tolist())
                output = int(event.tensor.rpartition("[")[2].rstrip("]")) if "[" in event.tensor else 0
                specs.append(GradSpec(output, row["hist"], row["zero"], bad=self.flags()[1][i]))
        return specs


@dataclass(frozen=True)
class Event:
    """One recorded tensor of the step: whose, which phase, which tensor, which call."""

    module: str
    phase: str
    tensor: str
    call: int | None = None


def _no_replay(call: int | None) -> str:
    """Why an event's module was not replayed."""
    if call == COMPILED:
        return "it ran inside torch.compile, where calls are not kept for a replay"
    if call == EARLIER:
        return "its forward ran before the previous step ended (a generator's output made before the " \
               "discriminator's step), and that step's calls are not kept"
    return "the call was released before the step ended"


def blame_backward(events: Sequence[Event], bad: Sequence[bool]) -> list[int]:
    """Where a non-finite gradient may have been born, most likely first: the events "grad of
    input k" that are bad, of modules whose incoming gradients (of their outputs) were all
    finite - innermost modules first, their parents after (a tensor hook sees the whole
    gradient of an input, which other users of that tensor add to: the replay decides).
    A module whose output needs no gradient is never one. Empty when every bad gradient came
    in from outside the modules (the loss, or code between modules)."""
    out_bad = _incoming_bad(events, bad, per_call=True)
    first_in: dict[tuple[str, int | None], int] = {}  # per call: a module called twice is two candidates
    for i, (event, is_bad) in enumerate(zip(events, bad, strict=True)):
        if is_bad and event.phase in _BACKWARD and event.tensor.startswith("grad of input"):
            first_in.setdefault((event.module, event.call), i)
    # a module no gradient came into (a causal mask built from an input's shape) has no
    # backward of its own: its input's gradient is what the input's other users made
    candidates = [key for key in first_in if out_bad.get(key) is False]

    def inside(inner: tuple[str, int | None]) -> int:  # how many other candidates lie inside this one
        return sum(_contains(inner[0], other[0]) for other in candidates)

    return [first_in[key] for key in sorted(candidates, key=lambda key: (inside(key), first_in[key]))]


def blame_parameter(events: Sequence[Event], bad: Sequence[bool], bad_params: Sequence[str]) -> str | None:
    """A parameter whose gradient went non-finite in a module whose incoming gradients were
    all finite (no input of it needed a gradient to show it): where it was born, or None."""
    out_bad = _incoming_bad(events, bad)
    for name in bad_params:
        owner = name.rpartition(".")[0] or "(model)"
        if out_bad.get(owner) is False:
            return name
    return None


def _incoming_bad(events: Sequence[Event], bad: Sequence[bool], per_call: bool = False) -> dict[Any, bool]:
    """Per module (or per call of it) with a recorded output gradient: whether any gradient
    coming into it was bad."""
    out_bad: dict[Any, bool] = {}
    for event, is_bad in zip(events, bad, strict=True):
        if event.phase in _BACKWARD and event.tensor.startswith("grad of output"):
            key = (event.module, event.call) if per_call else event.module
            out_bad[key] = out_bad.get(key, False) or is_bad
    return out_bad


def _contains(outer: str, inner: str) -> bool:
    return outer != inner and (outer == "(model)" or inner.startswith(outer + "."))
