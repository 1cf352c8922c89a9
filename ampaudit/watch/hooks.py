"""The hooks that record a step: module forward hooks and tensor gradient hooks turn every
measured tensor into one raw row of the step's arena (one kernel launch, no host sync) and
one event (module, phase, label), in execution order; at the step boundary the parameter
gradients get a row each (``record_params``).

Where the hooks see what:

- ``before_forward(module, args)``: the forward pre-hook - the module's inputs, before it
  runs (``inputs=True`` records them here);
- ``after_forward(module, args, kwargs, output)``: the forward hook - its inputs and its
  output; the output is recorded here, and a gradient hook put on each output tensor
  (``hook_grad``) records the gradient w.r.t. it as phase "backward". With ``provenance``,
  the call itself is kept for the step (``calls``: a replay names the op if this module turns
  out to be where a NaN was born), and a gradient hook on each input that needs a gradient
  records it as phase ``INPUT_GRAD``: the gradient this module's backward made.

Everything else waits for the step boundary (``reducer``).
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Callable
from threading import get_ident
from typing import Any

import torch
from torch.nn.modules import module as module_hooks

from ampaudit.core import native
from ampaudit.core.dtypes import LowDtype
from ampaudit.core.tensors import iter_tensors
from ampaudit.core.userframe import Loc, user_location
from ampaudit.watch import backward_tap, compiled, cpu_kernel, stats
from ampaudit.watch.arena import Handle, RowArena
from ampaudit.watch.call_context import (
    compiled_anything,
    compiling,
    functorch_level,
    graph_task,
    in_backward,
    legacy_batched,
    recomputed,
    transformed,
)
from ampaudit.watch.events import INPUT_GRAD, LOSS, LOSS_MODULE, NO_ROW, event
from ampaudit.watch.grad_hooks import add_grad_hook, last_hook, remove_grad_hook
from ampaudit.watch.hook_set import HookSet
from ampaudit.watch.layout import LAYOUT
from ampaudit.watch.loss_probe import LossProbe
from ampaudit.watch.measurable import measurable_tensors, positional, unmeasurable
from ampaudit.watch.module_names import ModuleNames
from ampaudit.watch.own_frames import passes_through
from ampaudit.watch.provenance import Call, autocast_state
from ampaudit.watch.threads import FollowedThread

COMPILED = -1  # the call of an event recorded inside a torch.compile'd region: none kept, no replay
EARLIER = -2  # the call of a gradient's event whose forward ran before an earlier step ended: not kept
# A step's rows (8 KB each on the CPU) past which a new forward after a backward ends it: a loop
# that updates its parameters by hand (`p.data.add_(p.grad, alpha=-lr)`, pytorch/examples'
# word_language_model) steps no optimizer, and its one step grew 2.7 MB an iteration (nanoGPT)
OVERDUE_ROWS = 8192
_RAISED = object()  # what ``_global_after_forward`` is called without when the forward raised


def detect_dtype(outputs: list[torch.Tensor]) -> tuple[LowDtype, str]:
    """The dtype a run uses, at its first forward, and why: autocast's if autocast is on, else
    a low-precision output's (a ``.half()`` / ``.bfloat16()`` model), else float16."""
    devices = {t.device.type for t in outputs} or {"cuda" if torch.cuda.is_available() else "cpu"}
    for device in sorted(devices):
        if torch.is_autocast_enabled(device):
            dtype, source = torch.get_autocast_dtype(device), f"autocast ({device})"
            break
    else:
        low = [t.dtype for t in outputs if t.dtype in (torch.float16, torch.bfloat16)]
        dtype, source = (low[0], "the model's own dtype") if low else (torch.float16, "default")
    if dtype not in (torch.float16, torch.bfloat16):  # autocast to something else: audit for fp16
        dtype, source = torch.float16, f"default (autocast to {dtype})"
    return LowDtype.parse(dtype), source


class _GradEvents:
    """A tensor's gradient hook: the events (module, phase, label, call) that record its
    gradient, in the order they asked. ``fired``: a backward has run it since its last event
    was added - those events are recorded, and a later forward's event replaces them
    (``StepRecorder.hook_grad``)."""

    __slots__ = ("events", "fired", "recorder", "step")

    def __init__(self, recorder: StepRecorder, entry: tuple[str, str, str, int | None]) -> None:
        self.recorder, self.events, self.fired, self.step = recorder, [entry], False, recorder.steps_ended

    def __call__(self, grad: torch.Tensor | None) -> None:
        self.fired = True
        recorder = self.recorder
        if recorder.loss_probe is not None:
            recorder.loss_probe.pause()  # the backward started: the loss code is behind
        # None: an output no loss depends on, of a compiled graph (nanoGPT's logits beside its loss)
        if recorder.logging and recorder.active and not recorder.paused and grad is not None:
            recorder._backward_since = True  # a new forward from now on is another micro-batch's
            # a torch.func transform's backward through a watched tensor, or autograd's batched one
            if functorch_level() is not None or legacy_batched(grad):
                with recorder.thread.lock:
                    recorder.unmeasured["functorch"] += len(self.events)
                return
            # a forward before an earlier step's end (a GAN's generator, before the discriminator's
            # step): its calls went with that step, its index means nothing in this one's
            earlier = self.step != recorder.steps_ended
            for module, phase, label, call in self.events:
                recorder.record(module, phase, grad, label, EARLIER if earlier else call)


class NotCopied:
    """A callback the recorder holds (its Monitor's): a deep copy of a watched model - an EMA
    copy, AveragedModel - copies the hooks and through them the recorder, but not the Monitor
    (it holds what cannot be copied: locks, thread-locals); the copy's recorder calls nothing."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self) -> None:
        self.fn()

    def __deepcopy__(self, memo: dict) -> None:
        return None


class StepRecorder:
    """Module and tensor hooks that fill this step's arena rows and events.

    With a model, hooks on its modules; with ``model=None`` (``ampaudit run``), PyTorch's
    global module hooks: every module that runs forward, named on first sight. ``logging``
    says whether the current step is recorded (set at each step boundary); ``limits`` is the
    audited dtype (detected at the first forward unless ``dtype_source`` is given)."""

    def __init__(self, limits: LowDtype, dtype_source: str | None, *, record_inputs: bool, record_eval: bool,
                 provenance: bool = True, inside_compile: bool = False, exact_histograms: bool = False) -> None:
        self.limits, self.dtype_source = limits, dtype_source  # ``limits``: a property (its thresholds' bits)
        self._dtype_open = dtype_source is None  # still looking for the run's dtype (``_detect_dtype``)
        self.record_inputs, self.record_eval, self.provenance = record_inputs, record_eval, provenance
        self.inside_compile = inside_compile  # modules inside a torch.compile'd region recorded (``compiled``)
        # a module's tensors: every element binned, or (CPU) big ones' histograms from a sample
        self.exact_histograms = exact_histograms
        self._fill = stats.fill_row if exact_histograms else stats.fill_sampled_row
        # a sampled row on the CPU kernel is written at its address (``_write``)
        self._at_address = not exact_histograms and cpu_kernel.available()
        self.logging = True  # this step is recorded
        self.active = False  # hooks attached (a gradient hook outlives detach: it checks)
        self.paused = False  # a replay runs modules: not the run's data
        self.arena = RowArena()  # this step's raw rows, filled in place by the kernels
        self.event_rows: list[Handle] = []  # arena handles, in execution order
        self.events: list[tuple[str, str, str]] = []  # (module, phase, tensor) of each row
        self.event_calls: list[int | None] = []  # each event's module call, in ``calls`` (provenance)
        # armed by the monitor after a NaN from the loss, or from the start (probe_loss)
        self.loss_probe: LossProbe | None = None
        # the step's gradients taken with create_graph=True (a gradient penalty), by their user's line
        self.graph_grads: list[Loc] = []
        self.calls: list[Call | None] = []  # this step's module calls (None: released)
        self.calls_frozen = False  # a micro-batch before this one went non-finite: keep its calls
        self._backward_since = False  # a gradient hook ran since the calls' micro-batch began (``_root_forward``)
        self._checked = 0  # this step's events checked for non-finite values at a new micro-batch (``_root_forward``)
        self._released = 0  # this step's calls released so far (``_root_forward``)
        self.steps_ended = 0  # how many steps ended (``end_step``): which step a gradient hook was put in
        # called at a new forward after a backward once the step holds OVERDUE_ROWS rows: ends it
        self.on_overdue: NotCopied | None = None
        # the model's forwards this step: after a backward (``_root_forward``: the step's first is none)
        self._forwards = 0
        # how many the first overdue step held: a step not recorded (``every``) ends after as many
        self.overdue_forwards: int | None = None
        self._call: int | None = None  # the call whose events are being recorded
        self._model: torch.nn.Module | None = None
        self.param_rows: dict[str, Handle] = {}  # parameter name -> arena handle
        self.eval_forwards = 0  # the model's grad-disabled calls
        self.unmeasured: Counter[str] = Counter()  # tensors skipped, by kind (sparse, nested, meta, ...)
        self.thread = FollowedThread()  # the one thread whose steps are recorded (watch/threads.py)
        # this step's measured tensors: (tensor, row, whether the whole row or only its flags)
        self._seen: dict[tuple[int, int], tuple[weakref.ref, Handle, bool]] = {}
        # this step's gradient hooks, by tensor id: (the tensor, the hook, what takes it off)
        self._grad_hooks: dict[int, tuple[weakref.ref, _GradEvents, Any]] = {}
        self.names = ModuleNames()
        self._names = self.names.by_id  # id(module) -> qualified name: the hot path's one lookup
        self._token = compiled.register(self.record_traced)  # how the op in a compiled graph finds this recorder
        self.sharded_params: set[str] = set()  # parameters whose gradients are DTensor shards (FSDP2)
        self._depth = 0  # module calls in flight (global mode: depth 0 is a root)
        self._handles: list[Any] = []
        self._module_hooks: HookSet | None = None  # the model's per-module hooks, once registered (``_arm``)
        self._idle_hooks: HookSet | None = None  # its root's hook between recorded steps (``_disarm``)
        self._armed = False  # a hook on every module of the model (else on its root only: ``_rearm``)
        self._compiled: list[weakref.ref] = []  # modules compiled in place, not named yet (``name_compiled``)
        self._compile_wrapper: Any = None  # nn.Module.compile as ``_follow_compile`` wrapped it

    @property
    def limits(self) -> LowDtype:
        """The audited dtype's limits (detected at the first forward unless given)."""
        return self._limits

    @limits.setter
    def limits(self, limits: LowDtype) -> None:
        self._limits = limits
        # as the C kernel takes them: fp32 bits of the overflow edge and of the smallest normal
        self._overflow_bits, self._low_bits = native.float_bits(limits.overflow_at), limits.normal_exponent << 23

    # -- attaching --------------------------------------------------------------------------------
    @property
    def hist_sample(self) -> int:
        """The log header's ``hist_sample``: how many elements a big CPU module tensor's histogram
        is estimated from; 0 when every element is binned (exact_histograms, or no C kernel)."""
        return 0 if self.exact_histograms or not cpu_kernel.available() else LAYOUT.hist_sample

    def attach(self, model: torch.nn.Module | None) -> None:
        self._model = model
        if model is not None:
            self.names.name_tree(model, "")
        else:
            self._follow_compile()
        self._arm()
        backward_tap.listen(self.on_backward)
        backward_tap.listen_graph_grads(self.on_graph_grad)
        self.active = True

    def _follow_compile(self) -> None:
        """Every module that runs forward is named by the global hooks as it runs - but one
        compiled in place (``model.compile()``) runs none outside its graph: ``nn.Module.compile``
        is wrapped to note it, for ``name_compiled``."""
        original = torch.nn.Module.compile
        noted = self._compiled

        @functools.wraps(original)
        def compile(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            noted.append(weakref.ref(module))
            return original(module, *args, **kwargs)

        passes_through(compile)
        compile.ampaudit_wraps = original  # type: ignore[attr-defined]
        torch.nn.Module.compile = compile
        self._compile_wrapper = compile

    def _arm(self) -> None:
        """A hook on every module of the model, or (``ampaudit run``) PyTorch's global module
        hooks: what a recorded step needs."""
        model = self._model
        if model is None:  # every module that runs forward, whoever built it
            self._handles.append(module_hooks.register_module_forward_pre_hook(self._global_before_forward))
            # always_call: a forward that raises (a batch skipped on OOM, caught) still ends its call
            self._handles.append(module_hooks.register_module_forward_hook(self._global_after_forward,
                                                                           with_kwargs=True, always_call=True))
        else:
            if self._module_hooks is None:  # registered once; switched off and on after (``HookSet``)
                self._module_hooks = self._register_module_hooks(model)
            self._module_hooks.on()
        self._armed = True

    def _register_module_hooks(self, model: torch.nn.Module) -> HookSet:
        """The hooks of a recorded step on the modules named at attach (one added since has no
        name, and would record nothing)."""
        # a new forward of the model: an earlier micro-batch's calls may go, an overdue step end
        handles = [model.register_forward_pre_hook(self._root_forward)]
        for module in model.modules():
            handles.append(module.register_forward_hook(self.after_forward, with_kwargs=True))
            if self.record_inputs:  # the pre-hook costs a call per module: only when it records
                handles.append(module.register_forward_pre_hook(self.before_forward))
        return HookSet(handles)

    def _disarm(self) -> None:
        """Between recorded steps (``every`` > 1) one hook that counts the model's eval calls:
        the root's, or a global one that does nothing else (naming new roots waits for a
        recorded step, where they run again). A hook on every module would cost each forward
        a Python call per module for nothing."""
        self._remove_handles()
        model = self._model
        if model is None:
            self._handles.append(module_hooks.register_module_forward_hook(self._global_idle_after_forward,
                                                                           with_kwargs=True))
        else:
            if self._idle_hooks is None:
                self._idle_hooks = HookSet([model.register_forward_hook(self.after_forward, with_kwargs=True)])
            self._idle_hooks.on()
        if self.overdue_forwards is not None:  # a loop updating by hand: the step's forwards end it
            self._handles.append(model.register_forward_pre_hook(self._idle_forward) if model is not None
                                 else module_hooks.register_module_forward_pre_hook(self._idle_forward))
        self._armed = False

    def _remove_handles(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for hooks in (self._module_hooks, self._idle_hooks):
            if hooks is not None:
                hooks.off()

    def detach(self) -> None:
        self._remove_handles()
        self._module_hooks = self._idle_hooks = None
        backward_tap.unlisten(self.on_backward)
        backward_tap.unlisten_graph_grads(self.on_graph_grad)
        self._unhook()
        self.active = False
        if self._compile_wrapper is not None:
            if torch.nn.Module.compile is self._compile_wrapper:  # else wrapped again since: left as it is
                torch.nn.Module.compile = self._compile_wrapper.ampaudit_wraps
            self._compile_wrapper = None

    # -- names ----------------------------------------------------------------------------------
    def name_compiled(self) -> None:
        """Name the modules compiled in place that no forward named, as roots: asked at a step's
        end, when a module around one (a model whose blocks alone are compiled) has run and named
        it within its own tree. Else their parameters would be ``param0``, ``param1``, ..."""
        while self._compiled:
            module = self._compiled.pop(0)()
            if module is not None and id(module) not in self._names:
                self.names.name_root(module)

    def param_name(self, param: torch.nn.Parameter) -> str:
        return self.names.param(param)

    def param_owners(self, name: str) -> list[str]:
        """The modules that hold the parameter called ``name`` (a tied weight: each of them)."""
        return self.names.param_owners(name)

    def module_name(self, module: torch.nn.Module) -> str | None:
        return self._names.get(id(module))

    # -- module hooks ---------------------------------------------------------------------------
    def before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """The forward pre-hook: the module's inputs, before it runs."""
        if self.paused or compiling() or (not torch.is_grad_enabled() and not self.record_eval) or recomputed():
            return
        if transformed() or not self.thread.here():  # counted in after_forward
            return
        if self._dtype_open and torch.is_grad_enabled():
            self._detect_dtype(measurable_tensors(args))
        if self.record_inputs and self.logging:
            name = self._names.get(id(module))
            for i, t in positional(args, self.unmeasured):
                if name is not None:
                    self.record(name, "input", t, f"input[{i}]")

    def after_forward(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """The forward hook: the module's inputs and its output, after it ran."""
        if compiling():
            self._trace_forward(module, args, output)
        elif not self._left_alone(output):
            self._record_call(module, args, kwargs, output)

    def _trace_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """A call traced by torch.compile: what changes between steps is read when the graph runs."""
        index = self.names.numbers.get(id(module)) if self.inside_compile else None
        if index is not None:
            compiled.trace_forward(self._token, index, output, measurable_tensors(output),
                                   positional(args) if self.provenance else [], record_eval=self.record_eval)

    def _left_alone(self, output: Any) -> bool:
        """Whether a call that ran is none of this recorder's: during a replay (``paused``), on
        another thread or in a torch.func transform (its outputs counted), or a checkpointed call
        recomputed in backward (recorded when it ran forward)."""
        # the followed thread outside any torch.func transform - nearly every call - asks no more
        here = functorch_level() is None and get_ident() == self.thread.ident
        return self.paused or (not here and self._elsewhere(output)) or (graph_task() != -1 and recomputed())

    def _record_call(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """A module call of the followed thread, run (not traced): its events and gradient hooks."""
        if self.loss_probe is not None and module is self._model:  # back on the stack as the model returned
            self.loss_probe.pause()  # (its global hook runs first): not for this hook's own calls
        name = self._names.get(id(module))
        phase = "forward"
        if not torch.is_grad_enabled():  # eval, generation: not training-step data
            self.eval_forwards += name == "(model)"  # the model's own calls
            if not self.record_eval:
                return
            phase = "eval"
        elif self._dtype_open:
            self._detect_dtype(measurable_tensors(output))
        if not self.logging or name is None:
            return
        self._call = None
        if self.provenance and phase == "forward" and not self.calls_frozen:
            self._call = len(self.calls)
            self.calls.append(Call(module, args, kwargs, autocast_state()))
            for i, t in positional(args, wrapped=False):  # no transform active: asked above
                if t.requires_grad:
                    self.hook_grad(t, name, f"grad of input[{i}]", INPUT_GRAD)
            for key, value in kwargs.items():  # transformers passes hidden_states by keyword
                if isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point():
                    self.hook_grad(value, name, f"grad of input[{key}]", INPUT_GRAD)
        for i, t in enumerate(measurable_tensors(output, skipped=self.unmeasured, wrapped=False)):
            label = "output" if isinstance(output, torch.Tensor) else f"output[{i}]"
            self.record(name, phase, t, label)
            if t.requires_grad:
                self.hook_grad(t, name, f"grad of {label}")
        self._call = None
        if self.loss_probe is not None and phase == "forward" and module is self._model:
            self.loss_probe.start()  # what the loop does with the output until the backward (not this hook's calls)

    def _elsewhere(self, output: Any) -> bool:
        """Whether a module call is one this recorder leaves alone - inside a ``torch.func``
        transform, or on a thread it does not follow (``threads``) - its float outputs counted
        as unmeasured. Never an error in the user's thread."""
        if transformed():
            kind = "functorch"
        elif self.thread.here(claim=torch.is_grad_enabled() or self.record_eval):
            return False
        else:
            kind = "other-thread"
        items = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) \
            else [output]
        n = sum(isinstance(t, torch.Tensor) and t.is_floating_point() for t in items)
        if n:
            with self.thread.lock:
                self.unmeasured[kind] += n
        return True

    def _global_before_forward(self, module: torch.nn.Module, args: Any) -> None:
        # a call recomputed in backward: non-reentrant checkpointing stops its recomputation inside
        # a module, whose forward hook never runs - counted, the depth of calls grew each step
        if self.paused or compiling() or recomputed():
            return
        if transformed() or not self.thread.here(claim=torch.is_grad_enabled() or self.record_eval):
            return  # counted when the call returns
        if self._depth == 0:  # (_root_forward takes the loss probe off the stack)
            if id(module) not in self._names:
                self.names.name_root(module)
            self._root_forward(module, args)
            if not self._armed:  # it ended an overdue step, the next not recorded: the idle hooks count no depth
                return
        self._depth += 1
        if self.record_inputs:
            self.before_forward(module, args)

    def _global_after_forward(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any = _RAISED) -> None:
        if output is _RAISED:  # the forward raised: torch calls an always_call hook as (module, args, None)
            # the depth its pre-hook counted comes off, or it stayed above 0 for good - no root named
            # again, no module hook taken off between recorded steps
            if not (self.paused or compiling() or recomputed() or transformed()) and self.thread.here(claim=False):
                self._depth = max(0, self._depth - 1)
            return
        if compiling():  # traced: only the recording op (inside_compile), no bookkeeping dynamo would guard on
            self._trace_forward(module, args, output)
            return
        if self._left_alone(output):
            return
        self._depth = max(0, self._depth - 1)
        self._record_call(module, args, kwargs, output)
        if self._depth == 0 and self.loss_probe is not None and self.logging and torch.is_grad_enabled():
            self.loss_probe.start()  # a module called outside all others returned: the loop's code follows

    def _global_idle_after_forward(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """The global hook between recorded steps: the model's eval calls, counted as
        ``after_forward`` counts them."""
        if torch.is_grad_enabled() or self.paused or compiling() or transformed():
            return
        if self._names.get(id(module)) == "(model)" and self.thread.here(claim=self.record_eval):
            self.eval_forwards += 1

    def _root_forward(self, module: torch.nn.Module, args: Any) -> None:
        """A new forward of the model after a backward within the step (gradient accumulation):
        the calls kept so far are released - unless that micro-batch already went non-finite
        (one host sync, only when a step has several forwards), whose calls a replay will need.
        A forward with no backward since is the same micro-batch's: a loss module, a GAN's
        discriminator, a siamese pair's second input - under ``ampaudit run`` every module
        called outside any other is a root - and so is a checkpointed block run again inside
        the backward."""
        if self.loss_probe is not None:
            self.loss_probe.step_aside()  # the model's own code: its modules' hooks see it
        if not self.logging:  # hooks kept on between recorded steps (torch.compile, the dtype not known yet)
            self._idle_forward(module, args)
            return
        if self.paused or not torch.is_grad_enabled():
            return
        if not self._backward_since or in_backward() or transformed() or not self.thread.here():
            return
        self._backward_since = False
        self._forwards += 1  # forwards after a backward: the step's first is not one
        if self.on_overdue is not None and self.arena.rows_used() >= OVERDUE_ROWS:
            if self.overdue_forwards is None:
                self.overdue_forwards = self._forwards  # what it held: this one begins the next step
            self._end_overdue()  # no step end in sight (a hand-made update): one here, before this forward
            return
        if not self.provenance or not self.calls or self.calls_frozen:
            return
        # the rows since the last micro-batch's check: the earlier ones were clean (else frozen)
        rows, self._checked = self.event_rows[self._checked:], len(self.event_rows)
        device = rows[0][0] if rows else torch.device("cpu")
        if rows and bool(stats.harmful(stats.raw_matrix(*self.arena.matrix(rows, device))).any()):
            self.calls_frozen = True
        else:  # released, each once: the indices stay the events'
            calls = self.calls
            for i in range(self._released, len(calls)):
                calls[i] = None
            self._released = len(calls)

    def _idle_forward(self, module: torch.nn.Module, args: Any) -> None:
        """A step not recorded (``every``) of a loop that updates by hand holds no rows to grow
        overdue: it ends at the model's forward after as many as the first overdue step held,
        which begins the next - else no step after the first overdue one would end, none be
        recorded again."""
        if self.overdue_forwards is None or self.on_overdue is None or self.paused or not torch.is_grad_enabled():
            return
        if compiling() or in_backward() or transformed() or not self.thread.here():
            return
        if self._model is None and self._names.get(id(module)) != "(model)":
            return
        self._forwards += 1
        if self._forwards > self.overdue_forwards:
            self._end_overdue()

    def _end_overdue(self) -> None:
        """End the step before the model's forward now starting, which the next step counts."""
        self.on_overdue()
        self._forwards = 1

    def _detect_dtype(self, outputs: list[torch.Tensor]) -> None:
        """A default (neither autocast nor a low dtype seen yet) is kept looking past until the
        first step ends: the low precision may begin inside the model - an fp32 embedding, then
        ``x.to(bfloat16)`` (nanochat) or autocast entered in a forward. Rows filled before then
        were classified for float16."""
        limits, source = detect_dtype(outputs)
        if self.dtype_source is None or not source.startswith("default"):
            self.limits, self.dtype_source = limits, source
        self._dtype_open = source.startswith("default")

    def on_graph_grad(self, frame: Any) -> Callable[[], None] | None:
        """The loop takes a gradient with create_graph=True (``backward_tap``): on a recorded step,
        its line - a later backward through it may bring a module a gradient its consumers did not
        (``blame``). It is loss code (a gradient penalty's): an armed probe, paused by the hooks
        it runs, records again after it."""
        if not (self.active and self.logging and not self.paused and self.thread.here(claim=False)):
            return None
        loc = user_location(frame)
        if loc is not None:
            self.graph_grads.append(loc)
        probe = self.loss_probe
        return probe.resumer() if probe is not None else None

    def on_backward(self, roots: Any) -> None:
        """A backward starts from ``roots`` (``backward_tap``): the loss, made outside every
        module, is an event of its own (flags only) on a recorded step; the loss probe, if
        armed, stops recording."""
        if transformed() or not self.thread.here(claim=False):  # another thread's backward: its own story
            return
        if self.loss_probe is not None:  # off the stack: the backward, the optimizer and the step's end run without it
            self.loss_probe.step_aside()
            # the loss: its backward may be replayed, with the step's other backwards (gradient accumulation)
            self.loss_probe.roots.extend(iter_tensors(roots))
        # no module of this watch ran forward in the step: another model's backward (a deep copy's); a
        # backward inside a backward (reentrant checkpointing's recomputed block): not the loss
        if not (self.active and self.logging and self.events) or self.paused or compiling() or in_backward():
            return
        for t in measurable_tensors(roots, skipped=self.unmeasured, wrapped=False):
            self.record(LOSS_MODULE, LOSS, t, "loss")

    # -- tensors --------------------------------------------------------------------------------
    def hook_grad(self, tensor: torch.Tensor, module: str, label: str, phase: str = "backward") -> None:
        """Record the gradient w.r.t. ``tensor`` when backward computes it (phase "backward").
        One hook per tensor and step: a module's output is often the next one's input, whose
        gradient it also wants - its event joins the hook already there when that hook is the
        tensor's last (a hook of the user's in between may change the gradient), so the events
        fire in the same order as with a hook each, at one Python call from autograd."""
        entry = (module, phase, label, self._call)
        known = self._grad_hooks.get(id(tensor))
        if known is not None and known[0]() is tensor and last_hook(tensor) is known[1]:
            hook = known[1]
            if hook.fired:  # a tensor that outlives a forward (a parameter passed as an input, under
                # gradient accumulation): the last micro-batch's backward recorded its events - kept,
                # each later backward recorded them again, 1 + 2 + ... + k events for k
                hook.events, hook.fired = [entry], False
            else:
                hook.events.append(entry)
            return
        hook = _GradEvents(self, entry)
        self._grad_hooks[id(tensor)] = (weakref.ref(tensor), hook, add_grad_hook(tensor, hook))

    def record(self, module: str, phase: str, tensor: torch.Tensor, label: str, call: int | None = None) -> None:
        """One event. Hot path: one raw row per tensor; everything else waits for the step
        boundary. A container often returns its last child's very tensor: measured once,
        counted for both."""
        whole = phase not in NO_ROW  # an input gradient or the loss is only a candidate first non-finite: flags do
        key = (id(tensor), tensor._version)
        row = self._seen.get(key)
        # a weak reference: never keeps activations alive; a flags-only row serves only flags
        if row is None or row[0]() is not tensor or (whole and not row[2]):
            row = self._seen[key] = (weakref.ref(tensor), self._write(tensor, whole), whole)
        self.event_rows.append(row[1])
        self.events.append((module, phase, label))
        self.event_calls.append(self._call if call is None else call)

    def _write(self, tensor: torch.Tensor, whole: bool) -> Handle:
        """``tensor`` into a new arena row: its whole row, or only its NaN/Inf flags. A plain
        CPU tensor's sampled row goes straight to the row's address on the C kernel (no
        tensor made for the row); the rest through ``stats``."""
        if whole and self._at_address and tensor.is_cpu and type(tensor) in stats.PLAIN:
            handle, counts_at, extras_at = self.arena.take_cpu()
            if cpu_kernel.fill_sampled_at(tensor, counts_at, extras_at, self._overflow_bits, self._low_bits):
                return handle
            counts, extras = self.arena.row(handle)
        else:
            handle, counts, extras = self.arena.take(tensor.device)
        (self._fill if whole else stats.fill_nonfinite)(tensor, counts, extras, self._limits)
        return handle

    def record_traced(self, tensor: torch.Tensor, module: int, kind: int, index: int) -> None:
        """One event from a compiled graph (``compiled``), as it runs: module number ``module``'s
        tensor of ``kind`` (``events.KINDS``), the ``index``-th."""
        if not (self.active and self.logging) or self.paused:
            return
        phase, label = event(kind, index)
        if self._dtype_open and phase == "forward":
            self._detect_dtype([tensor])
        self.record(self.names.numbered[module], phase, tensor, label, COMPILED)

    def record_params(self, params: list[tuple[str, torch.nn.Parameter]], scale: torch.Tensor | None) -> None:
        """A row per parameter gradient, at the step boundary: with its norm, and with a
        GradScaler how many gradients overflow at its current scale. Plain CPU gradients take
        one C call for all, at their rows' addresses (``cpu_kernel.fill_param_rows``)."""
        self.param_rows = rows_of = {}
        # a plain CPU gradient outside a transform is measurable: no question asked (``unmeasurable``)
        plain_cpu = cpu_kernel.available() and functorch_level() is None
        grads: list[torch.Tensor] = []
        addresses: list[tuple[int, int]] = []
        for name, p in params:
            grad = p.grad
            if grad is None:
                continue
            if plain_cpu and type(grad) is torch.Tensor and grad.is_cpu and grad.layout == torch.strided \
                    and not grad.is_nested:
                handle, counts_at, extras_at = self.arena.take_cpu()
                rows_of[name] = handle
                grads.append(grad)
                addresses.append((counts_at, extras_at))
                continue
            if stats.is_dtensor(grad):  # FSDP2: this rank's shard; the ranks' rows add up to the whole
                grad = grad.to_local()
                self.sharded_params.add(name)
            kind = unmeasurable(grad)
            if kind is not None:  # a sparse embedding's gradient, say
                self.unmeasured[kind] += 1
                continue
            handle, counts, extras = self.arena.take(grad.device)
            rows_of[name] = handle
            stats.fill_row(grad, counts, extras, self._limits, norm=True, scale=scale)
        if grads:  # on the CPU the scale is host memory: read at no cost
            cpu_kernel.fill_param_rows(grads, addresses, self._limits.overflow_at,
                                       float(scale) if scale is not None else None, self._limits.max)

    def end_step(self, logging_next: bool) -> None:
        """Forget this step's rows and events; ``logging_next``: whether the next is recorded."""
        self._unhook()
        self.event_rows, self.events, self.param_rows, self._seen, self._grad_hooks = [], [], {}, {}, {}
        self.event_calls, self.calls, self.calls_frozen, self._backward_since = [], [], False, False
        self._checked, self._released, self._forwards = 0, 0, 0
        self.graph_grads = []
        self.steps_ended += 1
        self.arena.reset()
        self._dtype_open = self.dtype_source is None
        self._rearm(logging_next)
        self.logging = logging_next

    def _unhook(self) -> None:
        """This step's gradient hooks off the leaf tensors still alive: a leaf lives across
        steps (a parameter passed to a module as its input - DETR's query embedding -, one a
        module returns) and would gather a hook a step, each backward running them all. An
        activation keeps its hook: its backward may come after this step's end - a GAN's
        generator output, made before the discriminator's step, gets its gradient in the
        generator's step, whose record it is then in."""
        for ref, _, added in self._grad_hooks.values():
            tensor = ref()
            if tensor is not None and tensor.is_leaf:  # no grad_fn (asked without making its Python object)
                remove_grad_hook(tensor, added)

    def _rearm(self, logging_next: bool) -> None:
        """The module hooks come off for steps not recorded (``_disarm``) and on again for the
        next recorded one: once the dtype is known, and never once torch.compile has compiled
        a graph in this process - a guard on the hooks would recompile it at each change -
        where they stay on. Under ``ampaudit run`` not while a module call is in flight (an
        inner loop's optimizer stepping inside a forward): the global hooks count the depth of
        calls, and the idle one does not."""
        if not self.active or self.dtype_source is None or self._depth:
            return
        if compiled_anything():
            logging_next = True
        if logging_next and not self._armed:
            self._remove_handles()
            self._arm()
        elif not logging_next and self._armed:
            self._disarm()
