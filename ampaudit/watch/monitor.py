"""``ampaudit.watch``: per-module forward/backward statistics, parameter gradients, loss
scale, and the first module that went non-finite - with at most one host sync per logged step.

``Monitor`` composes the units that do the work, each over the one row layout (``layout``):

- ``hooks.StepRecorder``: module and tensor hooks; each measured tensor fills one row of a
  preallocated device arena (one kernel, ``stats``) and becomes one event;
- ``boundary``: where a step ends - the optimizer's step hooks, or the GradScaler tap;
- ``reducer.StepReducer``: at the step boundary, the step's rows reduced on the device into
  one buffer (all-gathered under torch.distributed) and read back once, or kept as running
  totals on the device when nobody reads per-step numbers;
- ``decode.step_record``: the buffer read back, as the step's record;
- ``log_file.LogSink``: the records, written to the JSON-lines log; ``summary.SummaryBuilder``
  adds them up.
"""

from __future__ import annotations

import contextlib
import fnmatch
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ampaudit.core.arguments import require_module
from ampaudit.core.dtypes import FLOAT16, LowDtype
from ampaudit.core.errors import AmpauditError
from ampaudit.watch import compiled, forks
from ampaudit.watch.blame import trace_first, trace_parameter
from ampaudit.watch.boundary import OptimizerTap, ScalerTap, unwrap_optimizer
from ampaudit.watch.call_context import compiled_anything, recomputed, transformed
from ampaudit.watch.conditions import DeviceConditions
from ampaudit.watch.decode import step_record
from ampaudit.watch.events import LOSS, NO_ROW
from ampaudit.watch.fp8 import Fp8Recorder
from ampaudit.watch.hooks import NotCopied, StepRecorder
from ampaudit.watch.launch import launched
from ampaudit.watch.log_file import LogSink
from ampaudit.watch.log_text import LogLines
from ampaudit.watch.loss_notes import (
    ACROSS_RANKS,
    COMPILED,
    INSIDE_THE_PENALTY,
    PENALTY,
    TO_NAME_IT,
    dropped_calls,
    from_the_loss,
    named,
    unnamed,
)
from ampaudit.watch.loss_probe import ARMED_STEPS, LossProbe
from ampaudit.watch.measurable import unmeasurable
from ampaudit.watch.options import WatchOptions, resolve
from ampaudit.watch.reducer import ANY, HARMFUL, IGNORED, StepReducer
from ampaudit.watch.schedule import EverySchedule
from ampaudit.watch.step_guard import guard_for
from ampaudit.watch.summary import SummaryBuilder, describe_first

_CPU = torch.device("cpu")

__all__ = ["Monitor", "NonFiniteError", "WatchOptions", "stop_reason", "unmeasurable", "watch"]


class NonFiniteError(AmpauditError):
    """Raised at the step boundary with ``stop_on_nonfinite=True``."""

    exit_code = 1


def stop_reason(record: dict[str, Any], skips_in_row: int, stop_after_skips: int) -> str | None:
    """Why ``stop_on_nonfinite`` stops after this step, or None. Without a GradScaler any
    non-finite value stops. With one, a non-finite gradient on a step the scaler skips is the
    scaler doing its job (an init scale too high, a rare spike): it stops only on what the
    scale cannot fix - non-finite values in the forward, a scale below 1, or
    ``stop_after_skips`` skipped steps in a row."""
    first, scale = record["first_nonfinite"], record["scale"]
    where = describe_first(first) if first is not None else ""
    if scale is None:
        return f"non-finite values {where}" if first is not None else None
    if first is not None and first["phase"] == "forward":
        return f"non-finite values in the forward, which no loss scale fixes: {where}"
    if scale < 1:
        return f"the loss scale fell to {scale:g} at step {record['step']}: the gradients overflow at any scale"
    if skips_in_row >= stop_after_skips:
        return f"{skips_in_row} steps in a row skipped by the loss scaler (up to step {record['step']})"
    return None


class Monitor:
    """Hooks on ``model`` (or, with ``model=None``, on every module that runs forward and every
    optimizer that steps: ``ampaudit run``). Steps end at ``optimizer.step()``, at
    ``scaler.update()`` when a GradScaler is given, or at ``step()``; every ``every``-th one
    (of each optimizer that ends steps: ``schedule``) is recorded, audited against ``dtype``,
    and written to ``log`` (JSON lines) if given.
    With ``provenance`` (default), each module call of a recorded step is kept until its end,
    so that on a step where a value goes non-finite the module that made it is replayed to
    name the op; modules matching an ``ignore`` pattern (fnmatch) are never the first.
    ``guard`` (with a GradScaler): True, or the LR schedulers and EMAs to hold, makes a step
    the scaler skips leave them and BatchNorm's running statistics as they were (``StepGuard``).
    Under ``torch.compile`` the modules inside the compiled region are not recorded (their
    graph stays the one without watch); ``inside_compile`` records them with an op in the graph
    (no graph break; inductor's results may then differ in the last bits: ``compiled``).
    Use as a context manager, or ``start()`` / ``stop()``; read ``summary()`` or ``print()``.

    The options are a :class:`WatchOptions` (``options``), or its fields as keyword arguments
    (``every=10``), which set those fields of ``options``."""

    def __init__(self, model: torch.nn.Module | None = None, *, optimizer: torch.optim.Optimizer | None = None,
                 scaler: torch.amp.GradScaler | None = None, options: WatchOptions | None = None,
                 **keywords: Any) -> None:
        self.options = options = resolve(options, keywords, caller="Monitor()")
        require_module(model, "ampaudit.watch", optional=True)
        if options.inside_compile and not compiled.SUPPORTED:
            raise ValueError(f"inside_compile needs torch's effect tokens, which torch {torch.__version__} does not "
                             "have: update torch, or watch without it (the compiled region's own modules unrecorded)")
        optimizer = unwrap_optimizer(optimizer)  # Accelerate's wrapper: the torch optimizer inside
        self.guard = guard_for(options.guard, scaler, optimizer, model)
        self.ignore = options.ignore
        self._modes: dict[tuple[str, str], int] = {}  # (module, phase) -> reducer mode (IGNORED...)
        self._shape: tuple | None = None  # the last step's events, parameters and ``_step_shape``
        self.masks: set[str] = set()  # modules found (by a replay) to write -inf masks on purpose
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.every, self.stop_on_nonfinite = options.every, options.stop_on_nonfinite
        self.schedule = EverySchedule(options.every)  # which steps are recorded
        self.stop_after_skips = options.stop_after_skips
        self.log_path = Path(options.log) if options.log is not None else None
        distributed = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        # the run's processes, for the log's header: the group's, or before the script brings it
        # up (ampaudit run) the launch's - whose ranks then each record their own steps
        self._launch = (rank, world) if distributed else launched() or (0, 1)
        # None: the dtype the run uses, read at its first forward (autocast's, else the model's own)
        dtype = options.dtype
        self.recorder = StepRecorder(LowDtype.parse(dtype if dtype is not None else FLOAT16),
                                     "given" if dtype is not None else None, record_inputs=options.inputs,
                                     record_eval=options.eval, provenance=options.provenance,
                                     inside_compile=options.inside_compile,
                                     exact_histograms=options.exact_histograms)
        self.recorder.on_overdue = NotCopied(self._overdue)
        self.overdue_steps = 0  # steps ended by ``_overdue``: no optimizer, scaler or step() ended them
        self.fp8_history = options.fp8_history  # the delayed recipe's amax history, in steps
        self.fp8 = (Fp8Recorder(options.fp8_history, self.recorder.module_name, lambda: self.recorder.paused,
                                lambda: not transformed() and not recomputed() and self.recorder.thread.here())
                    if options.fp8 else None)  # float8 statistics: a unit of their own (watch/fp8.py)
        here = self.recorder.thread.here  # steps end on the thread the watch follows (watch/threads.py)
        self.optimizer_tap = OptimizerTap(self._boundary, optimizer, here)
        self.scaler_tap = ScalerTap(self._boundary, here)
        self.reducer = StepReducer(world)
        self._rank = rank
        self.sink = LogSink(self.log_path if rank == 0 else None)  # rank 0 writes the log
        self._lines = LogLines()  # its step records, as text
        self._conditions = DeviceConditions()  # the verdicts' per-step conditions, with the totals
        self.builder = SummaryBuilder(self.dtype_name)
        self.step_index = 0
        self._started = False
        self._model_params: list[tuple[str, torch.nn.Parameter]] = []
        self._last_scaler: torch.amp.GradScaler | None = None
        self._skips_in_row = 0
        self._stopping = False
        # recorded steps the loss probe stays armed for (``_probe_loss``); None: never armed, 0: done
        self._probe_steps: int | None = None
        self.probe_loss = options.probe_loss  # the loss probe armed from the first step, for good
        self.probe_loss_mb = options.probe_loss_mb  # what its kept calls may hold (``probe_budget``)
        # what a NaN from the loss the probe did not name says of that (``loss_notes``)
        self._probe_why = "" if options.probe_loss else TO_NAME_IT
        self.forks = 0  # processes forked while watching: not watched (watch/forks.py)
        self.forked_child = False  # this process is a fork of the one watch started in

    # -- what the units hold ------------------------------------------------------------------
    @property
    def limits(self) -> LowDtype:
        """The audited dtype: given, or detected at the first forward."""
        return self.recorder.limits

    @property
    def dtype_name(self) -> str:
        return self.recorder.limits.name

    @property
    def dtype_source(self) -> str | None:
        return self.recorder.dtype_source

    @property
    def record_inputs(self) -> bool:
        return self.recorder.record_inputs

    @property
    def record_eval(self) -> bool:
        """Grad-disabled forwards: recorded as phase "eval" (True) or not recorded (False)."""
        return self.recorder.record_eval

    @property
    def eval_forwards(self) -> int:
        """The model's grad-disabled calls."""
        return self.recorder.eval_forwards

    @property
    def unmeasured(self) -> dict[str, int]:
        """Tensors skipped, by kind (sparse, nested, meta)."""
        return self.recorder.unmeasured

    @property
    def logging(self) -> bool:
        """Whether the current step is recorded."""
        return self.recorder.logging

    # -- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Monitor:
        if self._started:
            return self
        # first: a log refused leaves no hook behind; closed in stop
        launch_rank, world = self._launch
        # "rank": the records are that rank's own, gathered from no other
        ranks = {"world": world} if world == self.reducer.world else {"world": world, "rank": launch_rank}
        self.sink.open({"dtype": self.dtype_name, "every": self.every, **ranks, "source": self.builder.source,
                        "hist_sample": self.recorder.hist_sample})
        self._started = True
        forks.track(self)
        self.recorder.attach(self.model)
        if self.fp8 is not None:  # after the recorder: its hooks name a module first
            self.fp8.attach(self.model)
        if self.model is not None:  # walked once, not every step; named as the recorder names them
            self._model_params = [(self.recorder.param_name(p), p) for p in self.model.parameters()]
        if self.guard is not None:
            self.guard.start()
        if self.reducer.world > 1:  # the probe never arms across processes: no way to name it to offer
            self._probe_why = ACROSS_RANKS if self.probe_loss else ""
        elif self.probe_loss:
            if compiled_anything():
                self._probe_why = COMPILED
            else:
                self.recorder.loss_probe, self._probe_steps = LossProbe(self.probe_loss_mb), ARMED_STEPS
                self.recorder.loss_probe.start()  # the first step's loss code, from here
        # a disabled GradScaler (``enabled=amp`` with amp off) steps the optimizer as it is: that
        # step ends the step, before the update a replay must not see (its update() comes after)
        if self.scaler is not None and (self.scaler.is_enabled() or self.optimizer is None):
            self.scaler_tap.attach(self.scaler)
        elif self.optimizer is not None:
            self.optimizer_tap.attach(self.optimizer)
        elif self.model is None:  # ampaudit run: every optimizer, and every GradScaler
            self.optimizer_tap.attach(None)
            self.scaler_tap.attach_all(self.optimizer_tap)
        return self

    def stop(self) -> None:
        if not self._started:
            return
        forks.untrack(self)
        self._detach()
        if self.recorder.events:
            self._stopping = True  # recorded, never raised: the run is over (or already stopping)
            self._flush_step(skipped=False)  # a partial last step still counts
        final_scale = None
        if self._last_scaler is not None and self._last_scaler._scale is not None:
            # the scale the next step would use: records carry the one each step used
            final_scale = self.builder.final_scale = float(self._last_scaler.get_scale())
        # what the live summary counts after the last logged step (eval after training, steps
        # `every` left out) reaches the log too: `ampaudit report` says the same
        self.sink.close({"steps": self.step_index, "forks": self.forks,
                         "eval_forwards": {"count": self.eval_forwards, "recorded": self.record_eval},
                         "unmeasured": dict(sorted(self.unmeasured.items()))}, final_scale)

    def _detach(self) -> None:
        self._started = False
        self.recorder.detach()
        if self.recorder.loss_probe is not None:  # a watch that ends between the forward and the backward
            self.recorder.loss_probe.leave()
            self.recorder.loss_probe = None
        if self.fp8 is not None:
            self.fp8.detach()
        if self.guard is not None:
            self.guard.stop()
        self.optimizer_tap.detach()
        self.scaler_tap.detach()

    def forked_here(self) -> None:
        """In a forked child: stop watching, leave the log to the parent, write nothing."""
        self._detach()
        self.sink.abandon()
        self.forked_child = True

    def forked_away(self) -> None:
        """In the parent, after a fork: what the child runs is not watched; count it."""
        self.forks += 1

    # -- step boundaries --------------------------------------------------------------------------
    def step(self, scaler: torch.amp.GradScaler | None = None) -> None:
        """Mark a step boundary by hand (loops without an optimizer or scaler hook, trainers'
        callbacks). With ``scaler`` - after its ``unscale_``, before its ``step`` - the step's
        skip (the scaler's found-inf flags) and its loss scale are recorded too."""
        self._boundary(scaler=scaler)

    def _overdue(self) -> None:
        """A step that no optimizer, GradScaler or ``step()`` ended holds ``OVERDUE_ROWS`` rows (a
        loop that updates its parameters by hand): it ends at the model's next forward, as
        ``step()`` there would, so that its rows stop growing. Said once."""
        if not self.overdue_steps:
            with contextlib.suppress(OSError, ValueError):  # a script may have closed stderr
                sys.stderr.write(f"ampaudit: {self.recorder.arena.rows_used()} tensors recorded and no optimizer step, "
                                 "GradScaler or step() has ended the watched step: it ends at the model's next "
                                 "forward each time one grows this large (a loop that updates the parameters by "
                                 "hand: call step() after the update; docs/watch.md)\n")
        self.overdue_steps += 1
        self._boundary()

    def _boundary(self, scaler: torch.amp.GradScaler | None = None) -> None:
        if self.recorder.loss_probe is not None:  # off the stack: the step's end makes no call through it
            self.recorder.loss_probe.step_aside()
        found_inf = scale = None
        if scaler is not None and scaler.is_enabled():
            self._last_scaler = scaler  # its scale after the last update() is read at stop()
            scale, found_inf = ScalerTap.read(scaler)
        # who ended the step: the GradScaler, else the optimizer that stepped (``schedule``)
        stepped = self.optimizer_tap.optimizers
        ender = scaler if scaler is not None else stepped[0] if stepped else None
        logged = self.recorder.logging and self.schedule.due(ender)
        if logged:
            self.recorder.record_params(self._params(), scale)
        self._flush_step(found_inf=found_inf, scale=scale, logged=logged, ender=ender)

    def _params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters whose gradients a step records: the model's, else the stepped optimizers'."""
        if self.model is not None:
            return self._model_params
        self.recorder.name_compiled()
        seen = [p for opt in self.optimizer_tap.optimizers for g in opt.param_groups for p in g["params"]]
        return [(self.recorder.param_name(p), p) for p in seen]

    def _flush_step(self, *, skipped: bool | None = None, found_inf: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None, logged: bool | None = None, ender: Any = None) -> None:
        """End the step; ``logged``: whether it is recorded (default: whether it was armed), ``ender``:
        who ended it (``schedule``)."""
        step, recorder = self.step_index, self.recorder
        logged = recorder.logging if logged is None else logged
        self.schedule.ended(ender)
        logging_next = self.schedule.arm_next()
        record = None
        # the fp8 rows leave the device before the step's own read, which then waits for them too
        fp8 = None
        if self.fp8 is not None:
            with forks.single_threaded(_CPU):
                fp8 = self.fp8.end_step(logging_next)
        if logged:
            keys, param_keys, modes, event_keys = self._step_shape()
            context = {"unmeasured": dict(recorder.unmeasured),  # so far: the builder keeps the latest
                       "dtype": self.dtype_name, "dtype_source": self.dtype_source,
                       "eval_forwards": recorder.eval_forwards, "forks": self.forks}
            with forks.single_threaded(_CPU):  # a forked child must never wait on threads watch started
                flat, buf = self._reduce(found_inf, scale, len(keys), param_keys, modes, event_keys)
                if self.reducer.world <= 1:
                    # Totals and the verdicts' conditions stay on the device; the step reads back
                    # only what it must decide (first non-finite, skipped, scale).
                    values = self.reducer.accumulate(flat, buf, keys, param_keys)
                    self._conditions.add(step, flat, keys, param_keys, scale, self.limits, found_inf)
                else:
                    flat = self.reducer.gather(flat, buf)
                    values = self.reducer.read(flat, buf)
            record = step_record(step, values, keys, param_keys, recorder.events, world=self.reducer.world,
                                 skipped=skipped, context=context)
            if fp8 is not None:
                record["fp8"] = fp8.read(self.fp8.kinds, self.fp8.formats)
            self._trace(record, values.first, modes,
                        [k for k, bad in zip(param_keys, values.param_nonfinite, strict=True) if bad])
            self._probe_loss(record)
            self.builder.add(record)
            if self.sink.is_open:  # the per-step rows, read back: the log's one extra read
                line = self._lines.line({**record, "layers": {}, "params": {}}, flat.cpu(), buf, keys, param_keys)
                self.sink.write_line(line, step)
        self.step_index += 1
        probe = recorder.loss_probe
        if probe is not None and probe.leave() and not self._probe_steps:  # this step's calls released
            recorder.loss_probe = probe = None  # no longer armed
        recorder.end_step(logging_next=logging_next)
        # last: the step's end makes no call it would record; a step not recorded is not judged (every=N)
        if probe is not None and not probe.on_stack and logging_next:
            probe.start()  # the next step's loop code, from its start: a loss weighted before the model call
        if record is not None:
            self._check_stop(record)

    def _reduce(self, found_inf: torch.Tensor | None, scale: torch.Tensor | None, n_keys: int, param_keys: list[str],
                modes: list[int], event_keys: list[int]) -> tuple[torch.Tensor, Any]:
        """The step's rows reduced into one buffer (``StepReducer.step_buffer``)."""
        recorder = self.recorder
        sharded = tuple(i for i, k in enumerate(param_keys) if k in recorder.sharded_params) \
            if recorder.sharded_params else ()
        return self.reducer.step_buffer(
            recorder.arena, recorder.event_rows, event_keys, n_keys, [recorder.param_rows[k] for k in param_keys],
            recorder.limits, found_inf, scale, modes=modes, sharded=sharded)

    def _step_shape(self) -> tuple[list[tuple[str, str]], list[str], list[int], list[int]]:
        """The step's (module, phase) keys and its parameters, sorted; per event, its mode
        (``_event_modes``) and its key's row (-1: an input gradient, in no row). A training
        loop records the same events step after step: worked out again only when they change
        (or a module turns out to write masks, which changes modes)."""
        recorder = self.recorder
        events, params = tuple(recorder.events), tuple(recorder.param_rows)
        if self._shape is not None and self._shape[0] == events and self._shape[1] == params:
            return self._shape[2]
        keys = sorted(set((module, phase) for module, phase, _ in events if phase not in NO_ROW))
        slot = {key: i for i, key in enumerate(keys)}
        shape = keys, sorted(params), self._event_modes(), [slot.get((m, p), -1) for m, p, _ in events]
        self._shape = events, params, shape
        return shape

    def _event_modes(self) -> list[int]:
        """Per event, which values make it a candidate first non-finite (``reducer.bad_events``)."""
        modes, known = [], self._modes
        for module, phase, _ in self.recorder.events:
            mode = known.get((module, phase))
            if mode is None:
                mode = known[(module, phase)] = self._mode(module, phase)
            modes.append(mode)
        return modes

    def _mode(self, module: str, phase: str) -> int:
        if any(fnmatch.fnmatchcase(module, p) for p in self.ignore):
            return IGNORED
        if phase in ("input", "eval") or (phase == "forward" and module in self.masks):
            return HARMFUL  # a -inf mask from the batch, or one a module writes on purpose
        return ANY

    def _trace(self, record: dict[str, Any], first_seq: float, modes: list[int], bad_params: list[str]) -> None:
        """On a step with a non-finite value only: the module, op and line that made it."""
        first, world = record["first_nonfinite"], self.reducer.world
        if first is None or not self.recorder.provenance:
            return
        if first_seq >= len(self.recorder.events) * world:  # only a parameter's gradient went non-finite
            if world == 1:
                record["first_nonfinite"] = trace_parameter(first, self.recorder, bad_params)
            return
        seq, rank = divmod(int(first_seq), world)
        if rank == self._rank:  # the module ran here: replay it here
            masks = len(self.masks)
            record["first_nonfinite"] = trace_first(first, seq, self.recorder, bad_params, modes, self.masks,
                                                    scaled=record.get("scale") is not None)
            if len(self.masks) != masks:
                self._modes.clear()  # a module found to write masks: its -inf no longer counts
                self._shape = None

    def _probe_loss(self, record: dict[str, Any]) -> None:
        """A NaN the loop's code made - the loss, or a bad gradient that came into the model from
        it (``loss_probe``): the first time, the probe is armed for the next recorded steps (once a run); on a step it
        recorded, the call that made it is named. Not with torch.compile in the process (a mode
        would change what it traces) nor across processes (each rank's loss code is its own)."""
        recorder = self.recorder
        probe, first = recorder.loss_probe, record["first_nonfinite"]
        if probe is not None and self._probe_steps:
            self._probe_steps -= not self.probe_loss
            origin = probe.origin() if from_the_loss(first) else None
            backward = origin is None and from_the_loss(first) and first.get("phase") != LOSS
            if backward:  # a finite loss whose gradient came into the model bad: made by its backward
                origin = probe.backward_origin()
            if origin is not None:
                record["first_nonfinite"] = named(first, origin, backward=backward)
                self._probe_steps = 0
            elif from_the_loss(first) and probe.dropped:  # the call that made it may be one it let go
                record["first_nonfinite"] = unnamed(first, dropped_calls(probe.dropped, len(probe.calls),
                                                                         self.probe_loss_mb))
            elif backward and probe.roots and str(first.get("note", "")).startswith(PENALTY):
                record["first_nonfinite"] = unnamed(first, INSIDE_THE_PENALTY)  # replayed: not the loss code's part
            elif self.probe_loss and compiled_anything():  # a mode would change what it traces
                self._probe_steps, self._probe_why = 0, COMPILED
        elif self._probe_steps is None and from_the_loss(first) and recorder.provenance and self.reducer.world <= 1 \
                and not compiled_anything():
            recorder.loss_probe, self._probe_steps = LossProbe(self.probe_loss_mb), ARMED_STEPS
        if from_the_loss(record["first_nonfinite"]) and self._probe_why:
            record["first_nonfinite"] = unnamed(record["first_nonfinite"], self._probe_why)

    def _check_stop(self, record: dict[str, Any]) -> None:
        """With ``stop_on_nonfinite``: raise once this step is recorded, if it calls for it."""
        self._skips_in_row = self._skips_in_row + 1 if record["skipped"] else 0
        if self.stop_on_nonfinite and not self._stopping:
            reason = stop_reason(record, self._skips_in_row, self.stop_after_skips)
            if reason is not None:
                raise NonFiniteError(reason)

    # -- results ----------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        with forks.single_threaded(_CPU):
            result = self.builder.summary(device=self._conditions.read())
            totals = self.reducer.totals()
        result["steps"] = max(result["steps"], self.step_index)
        result["dtype"] = self.dtype_name
        if totals is not None:  # totals kept on the device: read back once, now
            layers, params = totals
            for module, phases in layers.items():
                result["layers"].setdefault(module, {}).update(phases)
            result["params"].update(params)
            result["layers"] = dict(sorted(result["layers"].items()))
            result["params"] = dict(sorted(result["params"].items()))
        result["unmeasured"] = dict(sorted(self.unmeasured.items()))
        result["dtype_source"] = self.dtype_source or "default: no forward seen"
        result["eval_forwards"] = {"count": self.eval_forwards, "recorded": self.record_eval}
        result["forks"] = self.forks
        if self.guard is not None:
            result["guard"] = self.guard.summary()
        return result

    @property
    def step_applied(self) -> bool:
        """Whether the last optimizer step was applied (False: the GradScaler skipped it)."""
        if self.guard is None:
            raise AttributeError("step_applied needs watch(..., scaler=scaler, guard=True)")
        return self.guard.step_applied

    def print(self, file: Any = None) -> None:
        from ampaudit.core.console import make_console
        from ampaudit.watch.render import render_summary

        render_summary(self.summary(), make_console(file or sys.stdout))


def watch(model: torch.nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
          scaler: torch.amp.GradScaler | None = None, options: WatchOptions | None = None,
          **keywords: Any) -> Monitor:
    """Watch ``model`` while it trains: ``with ampaudit.watch(model, optimizer=opt, every=10) as mon: ...``.
    The options (``log``, ``every``, ``dtype``, ...) are :class:`WatchOptions`' fields, given as
    keyword arguments or as ``options=WatchOptions(...)``."""
    return Monitor(model, optimizer=optimizer, scaler=scaler,
                   options=resolve(options, keywords, caller="ampaudit.watch()"))
