"""A NaN made by the loss code - plain torch calls between the model's forward and its backward,
which no module hook sees - is named with its call and line at the next recorded step where it
happens again (``watch/loss_probe.py``); a healthy run never has the probe on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch

import ampaudit
from ampaudit.watch.loss_notes import LOSS_ITSELF, LOSS_SCALED
from tests.conftest import ROOT

THIS = os.path.abspath(__file__)


@pytest.fixture(autouse=True)
def _nothing_compiled(monkeypatch):
    # another test in this process may have compiled a graph: the probe is never armed then
    monkeypatch.setattr("ampaudit.watch.monitor.compiled_anything", lambda: False)


def _line(marker: str) -> int:
    """The line of this file that holds ``marker`` (a comment on the loss code's line)."""
    with open(THIS) as f:
        return next(i for i, text in enumerate(f, 1) if marker in text and "_line(" not in text)


def _train(loss_fn, steps: int = 6, log=None, stack: list | None = None, watched: bool = True, **options):
    """A tiny regression trained under a GradScaler on the CPU (fp32: it skips a step with
    NaN gradients, so the weights stay finite and the loss code goes bad again); ``watched``
    False: the same run without watch (its monitor None)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x, y = torch.randn(16, 4), torch.rand(16, 1)
    losses = []
    watch = ampaudit.watch(model, optimizer=opt, scaler=scaler, log=log, **options) if watched else nullcontext()
    with watch as monitor:
        for step in range(steps):
            out = model(x)
            loss = loss_fn(out, y, step)
            if stack is not None:
                stack.append(torch._C._len_torch_function_stack())
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    return monitor, losses


def _masked_mean(out, y, step):
    mask = torch.ones_like(y) if step < 2 else torch.zeros_like(y)  # an all-padding batch from step 2
    return ((out - y) ** 2 * mask).sum() / mask.sum()  # probe: 0 / 0


def _bce_by_hand(out, y, step):
    y = (y > 0.5).float()  # labels 0 and 1
    p = torch.sigmoid(out * (1.0 if step < 2 else 1e4))  # saturates to exactly 0 and 1 from step 2
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # probe: log(0) * 0


def test_a_division_by_zero_in_the_loss_code_is_named_at_the_next_step(tmp_path):
    monitor, losses = _train(_masked_mean, log=tmp_path / "w.jsonl")
    assert [loss == loss for loss in losses] == [True, True, False, False, False, False]
    records = [json.loads(line) for line in (tmp_path / "w.jsonl").read_text().splitlines()[1:-1]]
    firsts = [r["first_nonfinite"] for r in records]
    assert firsts[:2] == [None, None]
    assert (firsts[2]["module"], firsts[2]["phase"], firsts[2]["made_in"]) == ("(loss)", "loss", "loss")
    assert firsts[2]["note"].startswith(LOSS_SCALED) and "op" not in firsts[2]  # not armed yet
    source = f"{THIS}:{_line('probe: 0 / 0')}"
    assert (firsts[3]["op"], firsts[3]["source"]) == ("Tensor.div", source)
    first = monitor.summary()["first_nonfinite"]
    assert (first["step"], first["op"], first["source"]) == (2, "Tensor.div", source)
    assert first["note"] == (f"{LOSS_ITSELF} (NaN or Inf out of finite values); its gradients made the model's "
                             "non-finite too (named at step 3, where it happened again)")
    # the probe is off once it named it: the later steps say only where the gradient came from
    assert all("op" not in f for f in firsts[4:])
    report = subprocess.run([sys.executable, "-m", "ampaudit", "report", "--format", "json", str(tmp_path / "w.jsonl")],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert json.loads(report.stdout)["first_nonfinite"] == first


def test_a_log_of_zero_times_zero_names_the_log_not_the_product():
    monitor, _ = _train(_bce_by_hand)
    first = monitor.summary()["first_nonfinite"]
    assert (first["op"], first["source"]) == ("torch.log", f"{THIS}:{_line('probe: log(0) * 0')}")
    assert "-inf by arithmetic (a log of 0, say), which Tensor.mul at" in first["note"]


def test_a_healthy_run_never_has_the_probe_on():
    stack: list[int] = []
    monitor, _ = _train(lambda out, y, step: ((out - y) ** 2).mean(), stack=stack)
    assert stack == [0] * 6 and monitor.recorder.loss_probe is None
    assert monitor.summary()["first_nonfinite"] is None


def test_the_probe_leaves_the_stack_at_each_step_end_and_changes_no_value():
    """Armed, the probe is a torch function mode on the stack from one step's end to the next's,
    off once it named the call; the losses are the ones a run without watch computes, bit for bit."""
    stack: list[int] = []
    _, watched = _train(_masked_mean, stack=stack)
    assert stack == [0, 0, 0, 1, 0, 0]  # armed at step 2's end; off once step 3 named the call
    plain_stack: list[int] = []
    _, plain = _train(_masked_mean, stack=plain_stack, watched=False)
    assert plain_stack == [0] * 6
    assert str(plain) == str(watched)


def test_a_mode_the_loop_pushes_above_the_probe_is_left_alone():
    """A loop that enters its own torch function mode in the loss code and leaves it open past
    the step's end: the probe, below it, is not popped in its place (it stays paused until a
    later end finds it on top) and the loop's mode is still the one on top."""
    from torch.overrides import TorchFunctionMode

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    mine = Counting()

    def loss_fn(out, y, step):
        if step == 3:
            mine.__enter__()  # left open until after the step's end
        return _masked_mean(out, y, step)

    stack: list[int] = []
    monitor, _ = _train(loss_fn, steps=5, stack=stack)
    top = torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1)
    assert top is mine and Counting.calls > 0
    mine.__exit__(None, None, None)
    assert monitor.summary()["first_nonfinite"]["op"] == "Tensor.div"  # named at step 3 all the same
    while torch._C._len_torch_function_stack():  # the stranded probe, paused: off for the next test
        torch._C._pop_torch_function_stack()


def test_ampaudit_run_names_the_loss_line_of_an_unmodified_script(tmp_path):
    (tmp_path / "s.py").write_text(
        "import torch\ntorch.manual_seed(0)\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.05)\nscaler = torch.amp.GradScaler('cpu', init_scale=4.0)\n"
        "x, y = torch.randn(16, 4), torch.rand(16, 1)\n"
        "for step in range(5):\n"
        "    mask = torch.ones_like(y) if step < 2 else torch.zeros_like(y)\n"
        "    loss = ((m(x) - y) ** 2 * mask).sum() / mask.sum()\n"
        "    opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()\n"
        "print('done')\n")
    proc = subprocess.run([sys.executable, "-m", "ampaudit", "run", "--log", "w.jsonl", "s.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (proc.returncode, proc.stdout) == (0, "done\n"), proc.stderr
    report = subprocess.run([sys.executable, "-m", "ampaudit", "report", "--format", "json", "w.jsonl"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    first = json.loads(report.stdout)["first_nonfinite"]
    assert (first["step"], first["op"], first["source"]) == (2, "Tensor.div", f"{tmp_path / 's.py'}:9")


def test_with_torch_compile_in_the_process_the_probe_is_never_armed(monkeypatch):
    monkeypatch.setattr("ampaudit.watch.monitor.compiled_anything", lambda: True)
    stack: list[int] = []
    monitor, _ = _train(_masked_mean, stack=stack)
    assert stack == [0] * 6 and monitor.recorder.loss_probe is None
    assert monitor.summary()["first_nonfinite"]["note"].startswith(LOSS_SCALED)


def test_a_watch_that_ends_in_the_loss_code_takes_the_probe_off_the_stack(tmp_path):
    """An exception between the model's forward and the backward ends the watch there (its
    ``with`` block): an armed probe, on the stack since the model returned, comes off with it."""

    def loss_fn(out, y, step):
        if step == 3:  # armed at step 2's end: on the stack now
            raise KeyboardInterrupt
        return _masked_mean(out, y, step)

    with pytest.raises(KeyboardInterrupt):
        _train(loss_fn)
    assert torch._C._len_torch_function_stack() == 0


def test_loss_code_before_the_model_call_is_named_too():
    """EDM2's loss (a plain class) weights each sample by its noise level before it calls the
    model: ``(sigma ** 2 + 0.25) / (sigma * 0.5) ** 2``, which overflows once sigma underflows (a
    P_mean of -50 for -0.4). The probe records from the step's start, so the weight's line is
    named - not the model call's, nor ``opt.zero_grad()``'s reads of the skipped step's ``.grad``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x = torch.randn(16, 4)
    with ampaudit.watch(model, optimizer=opt, scaler=scaler) as monitor:
        for step in range(5):
            opt.zero_grad()
            sigma = (torch.randn(16, 1) + (-0.4 if step < 2 else -50.0)).exp()
            weight = (sigma ** 2 + 0.25) / (sigma * 0.5) ** 2  # probe: the weight overflows
            loss = (weight * (model(x + sigma * torch.randn_like(x)) - x) ** 2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    first = monitor.summary()["first_nonfinite"]
    assert (first["step"], first["op"], first["source"]) == (2, "Tensor.div", f"{THIS}:{_line('probe: the weight')}")


def test_min_snr_weighting_with_a_zero_terminal_snr_schedule_names_the_division():
    """kohya-ss/sd-scripts' shape: min-SNR-gamma weights ``min(snr, 5) / snr`` per sample, the SNR
    looked up per timestep in a table; a zero-terminal-SNR schedule makes the last timestep's SNR
    exactly 0, and epsilon prediction divides by it (on sd-scripts' own apply_snr_weight:
    ``torch.div at library/custom_train_functions.py:74``)."""
    alphas_cumprod = torch.cat([torch.linspace(0.999, 0.01, 9), torch.zeros(1)])  # terminal SNR 0
    all_snr = alphas_cumprod / (1 - alphas_cumprod)

    def snr_weighted(out, y, step):
        timesteps = torch.tensor([9, 3] * 8) if step >= 2 else torch.tensor([1, 3] * 8)
        snr = torch.stack([all_snr[t] for t in timesteps])
        weight = torch.div(torch.minimum(snr, torch.full_like(snr, 5.0)), snr)  # probe: min-SNR weight
        return (((out - y) ** 2).mean(1) * weight).mean()

    monitor, _ = _train(snr_weighted)
    first = monitor.summary()["first_nonfinite"]
    assert (first["step"], first["op"], first["source"]) == (2, "torch.div", f"{THIS}:{_line('probe: min-SNR')}")


@pytest.mark.parametrize("reentrant", [True, False])
def test_only_the_loop_s_own_backward_is_the_loss(reentrant):
    """Reentrant activation checkpointing runs a backward of its recomputed block inside the
    step's backward: that is not the loss. One loss event a step, whichever checkpointing."""
    from torch.utils.checkpoint import checkpoint

    class Blocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.b(checkpoint(lambda h: torch.relu(self.a(h)), x, use_reentrant=reentrant))

    torch.manual_seed(0)
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with ampaudit.watch(model, optimizer=opt) as monitor:
        for _ in range(3):
            loss = model(torch.randn(5, 4).requires_grad_()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            losses.append([e for e in monitor.recorder.events if e[1] == "loss"])
            opt.step()
    assert losses == [[("(loss)", "loss", "loss")]] * 3
    assert monitor.summary()["first_nonfinite"] is None


def test_an_armed_probe_lets_the_model_be_deep_copied_mid_step():
    """An EMA copy made in the loop's code after the forward: the recorder is copied with the
    model's hooks, and both the calls the probe holds and the module calls kept for replays carry
    autograd history, which ``copy.deepcopy`` refuses ("Only Tensors created explicitly by the
    user..."). The copy gets neither; the run goes on."""
    import copy

    copies = []

    def loss_fn(out, y, step):
        loss = _masked_mean(out, y, step)
        if step == 3:  # armed at step 2's end: the probe holds this step's calls
            copies.append(copy.deepcopy(loss_fn.model))
        return loss

    torch.manual_seed(0)
    loss_fn.model = model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x, y = torch.randn(16, 4), torch.rand(16, 1)
    with ampaudit.watch(model, optimizer=opt, scaler=scaler) as monitor:
        for step in range(5):
            loss = loss_fn(model(x), y, step)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert len(copies) == 1 and monitor.summary()["first_nonfinite"]["op"] == "Tensor.div"


def test_a_mode_the_loop_entered_before_the_probe_keeps_its_place():
    """A loop inside ``with torch.device("cpu"):`` (a torch function mode) whose loss goes bad,
    watched from outside that block (``ampaudit run``): the probe, pushed above the device mode at
    a step's end, was the mode that block's ``__exit__`` popped - the device context stayed on after
    the block, the default device of the rest of the script. The probe never goes on above a mode
    it did not see come and go."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x, y = torch.randn(16, 4), torch.rand(16, 1)
    monitor = ampaudit.watch(model, optimizer=opt, scaler=scaler).start()
    try:
        with torch.device("cpu"):
            for step in range(3):  # armed at the last step's end: the block ends with the probe armed
                loss = _masked_mean(model(x), y, step)
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        assert torch._C._len_torch_function_stack() == 0  # the block's mode is gone with it
    finally:
        monitor.stop()
    assert torch._C._len_torch_function_stack() == 0


def test_the_backward_tap_comes_off_and_leaves_a_later_wrapper_in_place():
    """One wrapper of ``torch.autograd.backward`` for all watches, off with the last; where the
    script wrapped it since, that wrapper stays on (ours passing through inside it) and a later
    watch tells its listeners once a backward, not twice."""
    from ampaudit.watch import backward_tap

    original, seen = torch.autograd.backward, []
    backward_tap.listen(seen.append)
    assert torch.autograd.backward.__wrapped__ is original  # functools.wraps: the signature and doc stay
    x = torch.ones(2, requires_grad=True)
    (x * 2).sum().backward()
    inner = torch.autograd.backward

    def theirs(*args, **kwargs):
        return inner(*args, **kwargs)

    torch.autograd.backward = theirs
    try:
        backward_tap.unlisten(seen.append)
        assert torch.autograd.backward is theirs
        backward_tap.listen(seen.append)
        (x * 2).sum().backward()
        backward_tap.unlisten(seen.append)
        assert torch.autograd.backward is theirs
        (x * 2).sum().backward()
        assert len(seen) == 2
    finally:
        torch.autograd.backward = original
        backward_tap._wrapper = None


def _train_unscaled(loss_fn, steps: int = 5, watched: bool = True, stack: list | None = None, setup_calls: int = 0,
                    **options):
    """The regression of ``_train`` without a GradScaler (an fp32 or bf16 run): the first bad
    step's NaN gradients go into the weights, and every later step is NaN from the model on.
    ``setup_calls``: torch calls the script makes with the watch on, before its first step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 4), torch.rand(16, 1)
    watch = ampaudit.watch(model, optimizer=opt, **options) if watched else nullcontext()
    with watch as monitor:
        t = torch.ones(2, requires_grad=True)
        for _ in range(setup_calls):  # a script's own set-up: kept within the probe's window, not ahead of it
            t = t * 1.0
        for step in range(steps):
            loss = loss_fn(model(x), y, step)
            if stack is not None:
                stack.append(torch._C._len_torch_function_stack())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return monitor, [p.detach().clone() for p in model.parameters()]


def test_without_a_scaler_a_nan_that_never_recurs_is_named_only_with_probe_loss():
    """No GradScaler: step 2's 0/0 puts NaN into the weights, so no later step's loss code makes
    it again and the probe armed after it finds nothing; the note says how to name it. With
    probe_loss the probe is on from the first step and names the division at step 2 itself."""
    monitor, _ = _train_unscaled(_masked_mean)
    first = monitor.summary()["first_nonfinite"]
    assert (first["step"], first["phase"]) == (2, "loss") and "op" not in first
    assert first["note"].endswith(" (to name its line where it does not happen again: `ampaudit run --probe-loss`, "
                                  "watch(probe_loss=True))")
    stack: list[int] = []
    monitor, weights = _train_unscaled(_masked_mean, probe_loss=True, stack=stack)
    first = monitor.summary()["first_nonfinite"]
    assert (first["step"], first["op"], first["source"]) == (2, "Tensor.div", f"{THIS}:{_line('probe: 0 / 0')}")
    assert first["note"] == (f"{LOSS_ITSELF} (NaN or Inf out of finite values); its gradients made the model's "
                             "non-finite too")
    assert stack == [1, 1, 1, 0, 0]  # on the stack in the loss code until it named the call
    assert torch._C._len_torch_function_stack() == 0
    _, plain = _train_unscaled(_masked_mean, watched=False)
    for a, b in zip(weights, plain, strict=True):  # NaN where the run put it, the rest bit for bit
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_probe_loss_keeps_the_latest_calls_so_a_long_setup_does_not_crowd_out_the_loss_code():
    from ampaudit.watch.loss_probe import MAX_CALLS

    monitor, _ = _train_unscaled(_masked_mean, probe_loss=True, setup_calls=MAX_CALLS + 100)
    assert monitor.summary()["first_nonfinite"]["op"] == "Tensor.div"


def test_probe_loss_on_a_healthy_run_changes_no_value_and_leaves_the_stack_empty():
    def mse(out, y, step):
        return ((out - y) ** 2).mean()

    stack: list[int] = []
    monitor, watched = _train_unscaled(mse, probe_loss=True, stack=stack)
    assert stack == [1] * 5 and torch._C._len_torch_function_stack() == 0
    assert monitor.summary()["first_nonfinite"] is None
    _, plain = _train_unscaled(mse, watched=False)
    assert all(torch.equal(a, b) for a, b in zip(watched, plain, strict=True))


def test_probe_loss_steps_off_the_stack_for_a_compiled_model_and_stops_once_something_compiled(monkeypatch):
    """The mode is off the stack while the model runs, so torch.compile traces the model as it
    would without it; once a graph has compiled, the probe stops at the next step's end."""
    compiled = {"any": False}
    monkeypatch.setattr("ampaudit.watch.monitor.compiled_anything", lambda: compiled["any"])
    seen: list[int] = []
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stack = []
    with ampaudit.watch(model, optimizer=opt, probe_loss=True) as monitor:
        model.register_forward_pre_hook(lambda m, a: seen.append(torch._C._len_torch_function_stack()))  # after watch's
        for step in range(4):
            loss = model(torch.randn(16, 4)).pow(2).mean()
            stack.append(torch._C._len_torch_function_stack())
            compiled["any"] = step >= 1
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert seen == [0, 0, 0, 0]  # the model never runs under the probe
    assert stack == [1, 1, 0, 0] and monitor.recorder.loss_probe is None


def test_probe_loss_names_a_nan_loss_without_provenance_too():
    """provenance=False keeps no module calls, and the blame then traces nothing to the loss
    code; a non-finite loss is the loop's all the same, and the probe names its call."""
    monitor, _ = _train_unscaled(_masked_mean, probe_loss=True, provenance=False)
    first = monitor.summary()["first_nonfinite"]
    assert (first["step"], first["op"], first["source"]) == (2, "Tensor.div", f"{THIS}:{_line('probe: 0 / 0')}")
    monitor, _ = _train_unscaled(_masked_mean, provenance=False)  # never armed without probe_loss
    first = monitor.summary()["first_nonfinite"]
    assert (first["step"], first["phase"]) == (2, "loss") and "op" not in first and monitor.recorder.loss_probe is None


def test_a_loss_function_compiled_with_fullgraph_trains_under_probe_loss_as_without_it():
    """Dynamo traces a torch function mode's own code: the probe's frame lookup broke a
    fullgraph compile of the loss function ("does not know how to trace sys._getframe") and
    the script with it; compiling, the mode only makes the call."""
    @torch.compile(backend="eager", fullgraph=True)
    def compiled(out, y, step):
        return ((out - y) ** 2).mean()

    _, watched = _train_unscaled(compiled, probe_loss=True)
    _, plain = _train_unscaled(compiled, watched=False)
    assert all(torch.equal(a, b) for a, b in zip(watched, plain, strict=True))


def _rmse(out, y, step):
    target = y if step < 2 else out.detach()  # a perfect prediction from step 2: the error is exactly 0
    return torch.sqrt(((out - target) ** 2).mean())  # probe: sqrt's slope at 0


def test_a_loss_whose_value_is_finite_and_gradient_is_not_names_the_backward_of_its_call():
    """RMSE at a perfect prediction: sqrt(0) = 0, but its backward is inf * 0 = NaN. No value
    of the loss code is bad, so the calls' backward is replayed from the loss: the node that
    made NaN of finite gradients is named with its call's line - at the step it happened
    with probe_loss, and at the next one through a GradScaler (the weights stay finite)."""
    source = f"{THIS}:{_line('probe: sqrt')}"
    note = ("it came into the model already non-finite, made by the loss code: its backward made NaN or Inf of "
            "finite gradients, its value finite (from torch.sqrt)")
    monitor, weights = _train_unscaled(_rmse, probe_loss=True)
    first = monitor.summary()["first_nonfinite"]
    assert (first["step"], first["phase"], first["op"], first["source"]) == (2, "backward", "SqrtBackward0", source)
    assert first["note"] == note
    _, plain = _train_unscaled(_rmse, watched=False)
    for a, b in zip(weights, plain, strict=True):  # the replay changed nothing the run computed
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    monitor, _ = _train(_rmse)
    first = monitor.summary()["first_nonfinite"]
    assert (first["step"], first["op"], first["source"]) == (2, "SqrtBackward0", source)
    assert first["note"] == f"{note} (named at step 3, where it happened again)"


def _rmse_of_noisy_targets(out, y, step):
    noise = torch.randn_like(y)  # the loss code's own draw: the replay of step 2 makes it again
    target = out.detach() if step == 2 else y + 0.1 * noise  # a perfect prediction at step 2: sqrt(0)
    return torch.sqrt(((out - target) ** 2).mean())


def test_the_backward_replay_leaves_the_random_generators_as_the_run_left_them():
    """The replay of step 2's loss code draws its noise again: the run went on from step 3 with
    other draws than without watch (the losses of steps 3 and 4 differed)."""
    monitor, watched = _train(_rmse_of_noisy_targets, probe_loss=True)
    assert monitor.summary()["first_nonfinite"]["op"] == "SqrtBackward0"  # replayed
    after = torch.rand(1)
    _, plain = _train(_rmse_of_noisy_targets, watched=False)
    assert watched == plain
    assert torch.equal(after, torch.rand(1))


class _RMSELoss(torch.nn.Module):
    """A criterion as a module, as training scripts write RMSE: no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.mse = torch.nn.MSELoss()

    def forward(self, out, target):
        return torch.sqrt(self.mse(out, target))  # probe: a criterion module's sqrt


_CROSS_ENTROPY = torch.nn.CrossEntropyLoss(label_smoothing=0.1)


def _rmse_module(out, y, step):
    return _RMSELoss()(out, y if step < 2 else out.detach())


def _smoothed_cross_entropy_of_a_banned_class(out, y, step):
    logits = torch.cat([out, -out], dim=1)
    banned = torch.tensor([False, step >= 2])  # from step 2 a class is banned: -inf, which smoothing reads
    return _CROSS_ENTROPY(logits.masked_fill(banned, float("-inf")), (y[:, 0] > 0.5).long())  # probe: CE module


@pytest.mark.parametrize(("loss_fn", "op", "marker"), [
    (_rmse_module, "SqrtBackward0", "probe: a criterion module's sqrt"),
    (_smoothed_cross_entropy_of_a_banned_class, "F.cross_entropy", "probe: CE module"),
])
def test_a_criterion_module_s_calls_are_the_loss_code(loss_fn, op, marker):
    """A module of no parameters (``nn.CrossEntropyLoss()``, a user's RMSELoss) is the loss
    code, not a network: the probe stepped off the stack for it as for the model, and its NaN
    went unnamed."""
    monitor, losses = _train(loss_fn, probe_loss=True)
    first = monitor.summary()["first_nonfinite"]
    assert (first["step"], first.get("op"), first.get("source")) == (2, op, f"{THIS}:{_line(marker)}")
    _, plain = _train(loss_fn, watched=False)  # recorded, it computes what it computes without watch
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain), rtol=0, atol=0, equal_nan=True)


def _energy_under_fp16_autocast(out, y, step):
    scale = 1.0 if step < 2 else 1e-5
    with torch.autocast("cpu", dtype=torch.float16):
        energy = (out * scale) @ (out * scale).T  # fp16 under autocast: from step 2 about 1e-10, which is 0
    return torch.sqrt(energy.float().diagonal()).mean()  # probe: sqrt of an fp16 underflow


def test_the_backward_replay_runs_each_call_under_the_autocast_it_ran_under():
    """Replayed without autocast, the matmul ran in fp32 (1e-10, not 0): the sqrt's backward
    stayed finite and the NaN went unnamed."""
    monitor, _ = _train(_energy_under_fp16_autocast, probe_loss=True)
    first = monitor.summary()["first_nonfinite"]
    assert (first["step"], first.get("op"), first.get("source")) == \
        (2, "SqrtBackward0", f"{THIS}:{_line('probe: sqrt of an fp16 underflow')}")


def test_the_backward_replay_runs_no_hook_the_loss_code_registered():
    """A loop that logs its loss gradient from a tensor hook: the replay registered the hook on
    its copy and its backward ran it again - step 2 logged twice."""
    logged = []

    def rmse_logging_its_gradient(out, y, step):
        error = out - (y if step != 2 else out.detach())
        error.register_hook(lambda grad: logged.append(step))
        return torch.sqrt((error ** 2).mean())

    monitor, _ = _train(rmse_logging_its_gradient, steps=4, probe_loss=True)
    assert monitor.summary()["first_nonfinite"]["op"] == "SqrtBackward0"  # replayed
    assert logged == [0, 1, 2, 3]


@pytest.mark.parametrize("bad_micro_batch", [0, 1])
def test_the_backward_replay_runs_every_backward_of_a_step_of_gradient_accumulation(bad_micro_batch):
    """Two micro-batches a step: the replay ran backward from the last one's loss only, and a
    sqrt at 0 in the first went unnamed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x, y = torch.randn(16, 4), torch.rand(16, 1)
    with ampaudit.watch(model, optimizer=opt, scaler=scaler, probe_loss=True) as monitor:
        for step in range(4):
            opt.zero_grad()
            for micro in range(2):
                out = model(x[micro * 8:(micro + 1) * 8])
                perfect = step == 2 and micro == bad_micro_batch
                target = out.detach() if perfect else y[micro * 8:(micro + 1) * 8]
                loss = torch.sqrt(((out - target) ** 2).mean()) / 2  # probe: a micro-batch's sqrt
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    first = monitor.summary()["first_nonfinite"]
    assert (first["step"], first.get("op"), first.get("source")) == \
        (2, "SqrtBackward0", f"{THIS}:{_line('probe: a micro-batch')}")


def test_the_probe_keeps_neither_the_backward_call_nor_torchs_own_machinery():
    """``loss.backward()`` pauses the probe inside its own call: it was kept all the same, and a
    replay ran it; calls such as ``torch._set_grad_enabled`` are torch's, not the loop's."""
    seen = []
    real = ampaudit.watch.monitor.Monitor._probe_loss

    def spy(self, record):
        if self.recorder.loss_probe is not None:
            seen.append([name for func, *_ in self.recorder.loss_probe.calls
                         for name in [getattr(func, "__name__", "")]])
        return real(self, record)

    import unittest.mock

    with unittest.mock.patch.object(ampaudit.watch.monitor.Monitor, "_probe_loss", spy):
        _train_unscaled(lambda out, y, step: ((out - y) ** 2).mean(), steps=3, probe_loss=True)
    # from the watch's start: the helper's set-up (torch.ones) before the first step
    assert seen == [["ones", "sub", "pow", "mean"], ["sub", "pow", "mean"], ["sub", "pow", "mean"]]


def test_probe_loss_records_only_the_steps_the_watch_records():
    """every=2: a step the watch does not record is not judged, so the probe is off the stack
    through it (what it would keep is never read)."""
    stack: list[int] = []
    monitor, _ = _train_unscaled(_masked_mean, steps=6, probe_loss=True, stack=stack, every=2)
    assert stack == [1, 0, 1, 0, 0, 0]  # off for good once step 2 named the call
    first = monitor.summary()["first_nonfinite"]
    assert (first["step"], first["op"]) == (2, "Tensor.div")


class _Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=True)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x, pad):
        return self.head(self.enc(x, src_key_padding_mask=pad))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("watched", [True, False])
def test_an_eval_forward_between_steps_takes_torch_s_fast_path_as_without_watch(watched):
    """nn.TransformerEncoder and MultiheadAttention take their fused path in eval only while no
    torch function mode is on the stack; the armed probe sat there between steps, so an eval pass
    after a step whose loss went NaN took the slow path: a padded position came out as the layer's
    values instead of the fast path's 0 (the training loop printed other numbers under ampaudit run).
    The probe steps off the stack while a module runs."""
    torch.manual_seed(0)
    model = _Encoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x, y = torch.randn(4, 3, 8), torch.rand(4, 3, 1)
    pad = torch.tensor([[False, False, True]] * 2)
    evals = []
    with ampaudit.watch(model, optimizer=opt, scaler=scaler) if watched else nullcontext() as monitor:
        for step in range(4):
            model.train()
            loss = _masked_mean(model(x, torch.zeros(4, 3, dtype=torch.bool)), y, step)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            model.eval()
            with torch.no_grad():
                evals.append(model.enc(x[:2], src_key_padding_mask=pad))
    assert [e[:, 2].abs().sum().item() for e in evals] == [0.0] * 4  # the fast path's padding
    if watched:
        assert monitor.summary()["first_nonfinite"]["op"] == "Tensor.div"  # armed and named all the same


def test_a_loss_whose_gradients_the_loop_replaced_is_not_said_to_have_finite_gradients():
    """StyleGAN's loop (NVlabs/stylegan3 training_loop.py) runs nan_to_num over every .grad before
    the optimizer step, and its R1 penalty reaches the weights through autograd.grad's double
    backward, past every module hook: a NaN R1 term (a log of 0 times 0) left the parameters'
    gradients finite by the time watch read them, and the note said the gradients "stayed finite",
    which they had not. It names that case beside the mean over no elements."""
    torch.manual_seed(0)
    d = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LeakyReLU(0.2), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(d.parameters(), lr=1e-3)
    grads = []
    with ampaudit.watch(d, optimizer=opt) as monitor:
        real = torch.randn(3, 4).requires_grad_(True)
        logits = d(real)
        r1_grads = torch.autograd.grad(outputs=[logits.sum()], inputs=[real], create_graph=True)[0]
        r1_penalty = torch.log(r1_grads.square().sum(1) * 0) * 0  # NaN with NaN gradients
        (torch.nn.functional.softplus(-logits).squeeze(1) + r1_penalty).mean().backward()
        grads = [p.grad.isnan().any().item() for p in d.parameters()]
        for p in d.parameters():
            torch.nan_to_num(p.grad, nan=0, posinf=1e5, neginf=-1e5, out=p.grad)
        opt.step()
    first = monitor.summary()["first_nonfinite"]
    assert any(grads) and (first["module"], first["step"]) == ("(loss)", 0)
    assert "replaces non-finite gradients before the optimizer step (nan_to_num on .grad" in first["note"]


def test_a_module_the_loss_code_calls_outside_the_watch_leaves_the_probe_recording():
    """A perceptual loss - a frozen network of its own, not the watched model - called in the
    loss code: the probe steps off the stack while it runs and comes back when it returns, so the
    division after it is named."""
    feature = torch.nn.Linear(1, 1).requires_grad_(False)

    def loss_fn(out, y, step):
        distance = (feature(out) - feature(y)).abs()
        return _masked_mean(distance, y, step)

    monitor, _ = _train(loss_fn)
    first = monitor.summary()["first_nonfinite"]
    assert (first["op"], first["source"]) == ("Tensor.div", f"{THIS}:{_line('probe: 0 / 0')}")


def test_another_thread_returning_from_the_same_module_leaves_the_probe_on_this_one():
    """Hogwild-style threads share the model: another thread's call of the module the probe
    stepped aside for, returning first, put the probe back on that thread's mode stack - the
    training thread's loss code after it went unrecorded and the division unnamed."""
    import threading

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(1, 1).requires_grad_(False)

        def forward(self, x):
            if threading.current_thread() is threading.main_thread():
                other = threading.Thread(target=self, args=(x.detach(),))  # the same module, elsewhere
                other.start()
                other.join()
            return self.lin(x)

    feature = Shared()

    def loss_fn(out, y, step):
        return _masked_mean((feature(out) - feature(y)).abs(), y, step)

    monitor, _ = _train(loss_fn)
    first = monitor.summary()["first_nonfinite"]
    assert (first["op"], first["source"]) == ("Tensor.div", f"{THIS}:{_line('probe: 0 / 0')}")


def test_probe_loss_in_a_distributed_run_says_why_it_names_nothing():
    """Each rank's loss code is its own: the probe never starts across processes, and a NaN
    from the loss says so instead of how to name it."""
    from ampaudit.watch.loss_notes import ACROSS_RANKS, unnamed

    model = torch.nn.Linear(2, 2)
    monitor = ampaudit.watch(model, probe_loss=True)
    monitor.reducer.world = 2  # as a process group of two would have it
    with monitor:
        assert monitor.recorder.loss_probe is None and torch._C._len_torch_function_stack() == 0
    assert monitor._probe_why == ACROSS_RANKS
    plain = ampaudit.watch(model)
    plain.reducer.world = 2
    with plain:  # nor is --probe-loss offered there
        pass
    assert plain._probe_why == ""
    first = unnamed({"note": "the loss was non-finite"}, monitor._probe_why)
    assert first["note"] == ("the loss was non-finite (probe_loss does not run across processes: each rank's loss "
                             "code is its own)")


def _warning_loss(out, y, step):
    copied = torch.tensor(out)  # warns: torch.tensor of a tensor (in C++)
    p = torch.nn.functional.softmax(out)  # warns: implicit dim (in Python, with a stacklevel)
    _ = (out * 2).grad  # warns: .grad of a non-leaf (an attribute read)
    return ((p - y) ** 2).mean() + 0 * copied.sum()


def test_a_warning_torch_raises_in_the_loss_code_names_the_same_line_as_without_the_probe():
    """Python's ``warnings`` named the probe's frame (``loss_probe.py``) for a warning torch
    raised inside a call the mode handled: C++'s innermost Python frame, or one level of a
    Python warning's stacklevel. Each names the loss code's own line with the probe on, as without it."""
    seen = {}
    for watched, options in ((False, {}), (True, {"probe_loss": True})):
        with pytest.warns(UserWarning) as caught:
            _train(_warning_loss, steps=2, watched=watched, **options)
        seen[watched] = [(w.filename, w.lineno, str(w.message)[:30]) for w in caught
                         if "copy construct" in str(w.message) or "Implicit dimension" in str(w.message)
                         or ".grad attribute" in str(w.message)]
    lines = [_line("warns: torch.tensor"), _line("warns: implicit dim"), _line("warns: .grad of")]
    assert [(f, n) for f, n, _ in seen[False]] == [(THIS, n) for n in lines] * 2
    assert seen[True] == seen[False]


def test_the_probe_keeps_at_most_its_budget_of_what_the_loss_code_made():
    """The kept calls hold what they made until the step's end: bounded in bytes, not only in
    count. Counted once per storage, however many kept calls hold it; what was there before the
    loss code (``x``, a view of it) is not counted; a storage a dropped call made that a kept call
    read still is. Over the budget, the oldest calls go."""
    from ampaudit.watch.loss_probe import LossProbe
    from ampaudit.watch.loss_replay import op_name
    from ampaudit.watch.probe_budget import MB

    x = torch.randn(512, 512, requires_grad=True)  # 1 MiB, made before the loss code
    probe = LossProbe(budget_mb=3)
    probe.start()
    try:
        flat = x.view(-1)  # a view of x: nothing made
        a = x * 2  # 1 MiB each
        b = a + 1
        assert probe.budget.held == 2 * MB and probe.dropped == 0
        c = b.exp()
        d = c.sum()  # 4 bytes: 3 MiB + 4 in all, over: the view, then x * 2 go; a, which a + 1 read, is held
        # until a + 1 goes too
        assert [op_name(call[0]) for call in probe.calls] == ["Tensor.exp", "Tensor.sum"]
        assert probe.budget.held == 2 * MB + 4 and probe.dropped == 3
        e = d * x  # reads x (not counted) and d; makes 1 MiB: exp goes, and b with it
        assert [op_name(call[0]) for call in probe.calls] == ["Tensor.sum", "Tensor.mul"]
        assert probe.budget.held == 2 * MB + 4 and probe.dropped == 4
        big = torch.ones(4 * MB // 4, requires_grad=True).mul(1.0)  # 4 MiB alone: not kept at all
        assert [op_name(call[0]) for call in probe.calls] == [] and probe.budget.held == 0
    finally:
        probe.leave()
    assert probe.budget.held == 0 and probe.dropped == 0 and not probe.calls
    del flat, e, big


def _long_tail(out, y, step):
    mask = torch.ones_like(y) if step < 2 else torch.zeros_like(y)
    loss = ((out - y) ** 2 * mask).sum() / mask.sum()  # probe: tail 0 / 0
    big = out.expand(16, 65536)  # a view of the model's output: nothing made
    for _ in range(4):
        big = big * 1.0  # 4 MiB each
    return loss + 0 * big.mean()


def test_a_nan_made_by_a_call_the_budget_dropped_is_not_named_and_the_note_says_why():
    small, _ = _train(_long_tail, steps=3, probe_loss=True, probe_loss_mb=8)
    first = small.summary()["first_nonfinite"]
    assert first["step"] == 2 and "op" not in first
    # 19 calls: the last step's loss.item(), then zeros_like, sub, pow, mul, sum, div, expand, 4 muls
    # (4 MiB each), mean, mul, add and the GradScaler's to and mul; the 4th mul's 8 MiB (what it read
    # and made) are over the budget, and the mean keeps its 4 MiB: mean, mul, add, to and mul are kept
    assert first["note"].endswith(
        " (the loss probe kept only the step's latest 5 calls of the loss code, 14 dropped over 8 MiB of what they "
        "made or 512 calls: the call that made it may be one of those; a larger probe_loss_mb, `--probe-loss-mb`, "
        "keeps more)")
    default, _ = _train(_long_tail, steps=3, probe_loss=True)
    first = default.summary()["first_nonfinite"]
    assert (first["step"], first["op"], first["source"]) == (2, "Tensor.div", f"{THIS}:{_line('probe: tail 0 / 0')}")


def _wgan_gp(steps: int = 4, scaler: bool = False, **options):
    """WGAN-GP's critic step (pytorch/examples' and the improved-WGAN papers' shape): the gradient
    penalty takes the critic's gradient at interpolates with create_graph=True, and the loss's
    backward runs through that gradient's graph. From step 2 every tanh saturates: the critic's
    gradient is exactly 0, and the penalty's sqrt at 0 has an infinite slope."""
    torch.manual_seed(0)
    critic = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(critic.parameters(), lr=1e-3)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if scaler else None
    real, fake = torch.randn(64, 16), torch.randn(64, 16)
    with ampaudit.watch(critic, optimizer=opt, scaler=grad_scaler, **options) as monitor:
        for step in range(steps):
            alpha = torch.rand(64, 1)
            interp = (alpha * real + (1 - alpha) * fake) * (1e4 if step >= 2 else 1.0)
            interp.requires_grad_(True)
            out = critic(interp)
            grads = torch.autograd.grad(out, interp, torch.ones_like(out), create_graph=True)[0]  # gp: grad
            penalty = ((torch.sqrt((grads ** 2).sum(dim=1)) - 1) ** 2).mean()  # gp: sqrt at 0
            loss = critic(fake).mean() - critic(real).mean() + 10 * penalty
            opt.zero_grad()
            if grad_scaler is None:
                loss.backward()
                opt.step()
            else:
                grad_scaler.scale(loss).backward()
                grad_scaler.step(opt)
                grad_scaler.update()
    return monitor.summary()["first_nonfinite"]


def test_a_nan_born_in_the_backward_of_a_gradient_penalty_is_named():
    """The penalty's backward runs through the gradient's own graph, which reads the critic's
    activations: the NaN arrived at the tanh's output from there, not from its consumer, and was
    said to be made "between modules, in the code of `(model)`'s forward". The step's
    create_graph gradient says where it came from; the probe's replay starts from that gradient
    (run again, it would differentiate a copy cut from its inputs) and names the sqrt."""
    grad_line, sqrt_line = _line("gp: grad"), _line("gp: sqrt at 0")
    original = torch.autograd.grad
    lead = (f"it came into the model from the backward of a gradient the loop took with create_graph=True "
            f"({THIS}:{grad_line}: a gradient penalty)")
    first = _wgan_gp(probe_loss=True)
    assert (first["step"], first["module"], first["phase"], first["made_in"]) == (2, "1", "backward", "loss")
    assert (first["op"], first["source"]) == ("SqrtBackward0", f"{THIS}:{sqrt_line}")
    assert first["note"] == (f"{lead}, made by the loss code: its backward made NaN or Inf of finite gradients, "
                             "its value finite (from torch.sqrt)")
    # without the probe: where it came from, and how to name it; with a GradScaler it recurs and is named
    first = _wgan_gp()
    assert "op" not in first and first["note"] == (
        f"{lead} - the loss code's backward, which runs through that gradient's own graph and brings the model's "
        "activations gradients their consumers did not make (to name its line where it does not happen again: "
        "`ampaudit run --probe-loss`, watch(probe_loss=True))")
    first = _wgan_gp(steps=5, scaler=True)
    assert (first["step"], first["op"], first["source"]) == (2, "SqrtBackward0", f"{THIS}:{sqrt_line}")
    assert first["note"].endswith("(named at step 3, where it happened again)")
    assert torch.autograd.grad is original  # the tap came off with the last watch


class _SqrtInItsBackward(torch.autograd.Function):
    """Its backward is finite (0) but has a NaN backward of its own: sqrt at 0, times 0."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.sqrt(x * 0)


class _Act(torch.nn.Module):
    def forward(self, h):
        return _SqrtInItsBackward.apply(h)


def test_a_nan_born_in_the_double_backward_inside_the_model_says_why_it_is_not_named():
    """The penalty's backward through the critic's own second-order nodes: no replay runs them
    (the probe's starts from the gradient, the modules' run their first-order backward), and the
    note says so."""
    torch.manual_seed(0)
    critic = torch.nn.Sequential(torch.nn.Linear(16, 32), _Act(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(critic.parameters(), lr=1e-3)
    real, fake = torch.randn(64, 16), torch.randn(64, 16)
    with ampaudit.watch(critic, optimizer=opt, probe_loss=True) as monitor:
        alpha = torch.rand(64, 1)
        interp = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        out = critic(interp)
        grads = torch.autograd.grad(out, interp, torch.ones_like(out), create_graph=True)[0]  # inside: grad
        loss = critic(fake).mean() - critic(real).mean() + 10 * ((grads.norm(2, dim=1) - 1) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    first = monitor.summary()["first_nonfinite"]
    assert (first["step"], first["module"], first["made_in"]) == (0, "0", "loss") and "op" not in first
    assert first["note"] == (
        "it came into the model from the backward of a gradient the loop took with create_graph=True "
        f"({THIS}:{_line('inside: grad')}: a gradient penalty) - the loss code's backward, which runs through that "
        "gradient's own graph and brings the model's activations gradients their consumers did not make (replayed "
        "from that gradient, the loss code's own backward made no NaN or Inf: it was made in the double backward "
        "inside the model - that gradient's graph through the model's modules -, which no replay runs, so the op is "
        "not known)")
