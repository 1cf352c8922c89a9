"""StepGuard: a step the GradScaler skips leaves the scheduler, the EMA and BatchNorm as they were."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from ampaudit.watch.step_guard import StepGuard

BAD_STEP = 2


def _step(model, opt, scaler, sched, ema, x) -> None:
    """One GradScaler step, then the scheduler and the EMA, as a training loop does them."""
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    ema.update_parameters(model)


def _run(*, guard: bool, bad_batch: bool = True, steps: int = 5, named: bool = True):
    """A CPU GradScaler loop whose batch at BAD_STEP holds an inf (the scaler skips that step);
    with ``bad_batch=False`` that batch is left out entirely: what a guarded run should equal."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ema = AveragedModel(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    # named=False: as `ampaudit run --guard` builds it - no scaler, optimizer or model named
    guarded = ((StepGuard(scaler, opt, model=model, schedulers=[sched], emas=[ema]) if named
                else StepGuard(None, find=True)) if guard else None)
    if guarded:
        guarded.start()
    batches = [torch.randn(6, 4) for _ in range(steps)]
    batches[BAD_STEP][0, 0] = float("inf")
    if not bad_batch:
        del batches[BAD_STEP]
    for x in batches:
        _step(model, opt, scaler, sched, ema, x)
    if guarded:
        guarded.stop()
    state = {"params": [p.detach().clone() for p in model.parameters()],
             "bn": [b.clone() for b in model[1].buffers()], "lr": opt.param_groups[0]["lr"],
             "epoch": sched.last_epoch, "ema_n": int(ema.n_averaged),
             "ema": [p.detach().clone() for p in ema.module.parameters()]}
    return state, guarded


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_without_the_guard_a_skipped_step_moves_everything_else():
    state, _ = _run(guard=False)
    assert state["epoch"] == 5 and state["ema_n"] == 5
    assert not torch.isfinite(state["bn"][0]).all()  # the bad batch went into the running mean


def test_a_guarded_skipped_step_equals_leaving_the_batch_out():
    state, guard = _run(guard=True)
    reference, _ = _run(guard=False, bad_batch=False)
    assert guard.summary() == {"steps": 5, "skipped_steps": [BAD_STEP], "scheduler_steps_held": 1,
                               "ema_updates_held": 1, "batchnorm_restores": 1}
    assert (state["epoch"], state["lr"], state["ema_n"]) == (4, reference["lr"], 4)
    assert _same(state["bn"], reference["bn"])
    assert _same(state["params"], reference["params"])
    assert _same(state["ema"], reference["ema"])


def test_a_guard_that_names_no_model_restores_every_batchnorm_that_ran():
    # ampaudit run --guard: the BatchNorm found by a global forward hook as it first runs in a step
    state, guard = _run(guard=True, named=False)
    reference, _ = _run(guard=False, bad_batch=False)
    assert guard.summary() == {"steps": 5, "skipped_steps": [BAD_STEP], "scheduler_steps_held": 1,
                               "ema_updates_held": 1, "batchnorm_restores": 1}
    assert _same(state["bn"], reference["bn"])
    assert _same(state["params"], reference["params"]) and _same(state["ema"], reference["ema"])


def test_step_applied_per_step():
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    seen = []
    with StepGuard(scaler, opt) as guard:
        for step in range(3):
            loss = model(torch.ones(1, 2)).sum() * (float("nan") if step == 1 else 1.0)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            seen.append(guard.step_applied)
    assert seen == [True, False, True]
    assert "step" not in scaler.__dict__  # stop() put the class's method back


def test_an_ema_without_an_update_method_is_refused():
    with pytest.raises(TypeError, match="no update_parameters"):
        StepGuard(torch.amp.GradScaler("cpu"), emas=[object()])


def test_watch_with_a_guard():
    import io

    import ampaudit

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ema = AveragedModel(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    applied = []
    with ampaudit.watch(model, optimizer=opt, scaler=scaler, guard=[sched, ema]) as mon:
        for step in range(4):
            x = torch.randn(6, 4)
            if step == 1:
                x[0, 0] = float("inf")
            _step(model, opt, scaler, sched, ema, x)
            applied.append(mon.step_applied)
    assert applied == [True, False, True, True]
    summary = mon.summary()
    assert summary["guard"] == {"steps": 4, "skipped_steps": [1], "scheduler_steps_held": 1, "ema_updates_held": 1,
                                "batchnorm_restores": 1}
    assert summary["scaler"]["skipped_steps"] == [1]
    assert sched.last_epoch == 3 and int(ema.n_averaged) == 3
    assert torch.isfinite(model[1].running_mean).all()
    out = io.StringIO()
    mon.print(out)
    assert "1 skipped steps: held 1 scheduler steps and 1 EMA updates, restored BatchNorm 1 times" in out.getvalue()


def test_a_guard_needs_the_scaler():
    import ampaudit

    with pytest.raises(ValueError, match="guard needs the GradScaler"):
        ampaudit.watch(nn.Linear(2, 2), guard=True)


# -- as users use it (issue 28 item 10) ---------------------------------------------------------------

def _loop(batches, *, epoch_steps: int | None = None, ema: bool = True, **watch):
    """A watched GradScaler loop: a per-step scheduler (``epoch_steps`` None) or a per-epoch one,
    made after the watch starts, and an AveragedModel. Returns the LR after each scheduler step."""
    import ampaudit

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    lrs = []
    with ampaudit.watch(model, optimizer=opt, scaler=scaler, **watch) as mon:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # made late: still found
        average = AveragedModel(model) if ema else None
        for i, x in enumerate(batches):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if average is not None:
                average.update_parameters(model)
            if epoch_steps is None or (i + 1) % epoch_steps == 0:
                sched.step()
                lrs.append(opt.param_groups[0]["lr"])
    return lrs, mon.summary().get("guard"), average


def _batches(steps: int, bad: int | None):
    batches = [torch.randn(6, 4) for _ in range(steps)]
    if bad is not None:
        batches[bad][0, 0] = float("inf")
    return batches


def test_guard_true_finds_the_optimizers_scheduler_and_the_ema():
    """Before: guard=True restored BatchNorm only; the scheduler and the EMA moved on the skipped step."""
    lrs, guard, average = _loop(_batches(4, bad=1), guard=True)
    assert guard == {"steps": 4, "skipped_steps": [1], "scheduler_steps_held": 1, "ema_updates_held": 1,
                     "batchnorm_restores": 0}
    assert lrs == [0.05, 0.05, 0.025, 0.0125]  # held once, as if the batch were left out
    assert int(average.n_averaged) == 3
    # the classes are themselves again once the watch stops
    assert torch.optim.lr_scheduler.StepLR.step is torch.optim.lr_scheduler.LRScheduler.step
    assert "update_parameters" in AveragedModel.__dict__ and not hasattr(AveragedModel.update_parameters,
                                                                         "__wrapped__")


@pytest.mark.parametrize("given", [True, False], ids=["found", "named"])
def test_a_per_epoch_scheduler_is_not_held_for_the_epoch(given):
    """Three epochs of two steps, the first epoch's last step skipped: the epoch still ends.
    Before: LR 0.1/0.05/0.025 (the whole epoch held) instead of 0.05/0.025/0.0125."""
    import ampaudit

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    lrs = []
    with ampaudit.watch(model, optimizer=opt, scaler=scaler, guard=True if given else [sched]) as mon:
        for epoch in range(3):
            for x in _batches(2, bad=1 if epoch == 0 else None):
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.05, 0.025, 0.0125]
    assert mon.summary()["guard"]["skipped_steps"] == [1]
    assert mon.summary()["guard"]["scheduler_steps_held"] == 0


GUARDED_SCRIPT = '''
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
for step in range(4):
    x = torch.randn(6, 4)
    if step == 1:
        x[0, 0] = float("inf")
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
print(opt.param_groups[0]["lr"])
'''


@pytest.mark.parametrize("guard", [False, True], ids=["plain", "guard"])
def test_ampaudit_run_guard(tmp_path, guard):
    import subprocess
    import sys

    from tests.conftest import ROOT

    (tmp_path / "s.py").write_text(GUARDED_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "ampaudit", "run", *(["--guard"] * guard), "--log",
                           str(tmp_path / "w.jsonl"), str(tmp_path / "s.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) == (0.0125 if guard else 0.00625)  # held: as if the bad batch were left out
    held = "1 skipped steps: held 1 scheduler steps and 0 EMA updates"
    assert (held in " ".join(proc.stderr.split())) == guard


def test_a_scheduler_made_right_after_a_skipped_step_still_starts():
    """A scheduler's __init__ calls its own step(): never held, even right after a skipped step."""
    import ampaudit

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with ampaudit.watch(model, optimizer=opt, scaler=scaler, guard=True) as mon:
        x = torch.randn(6, 4)
        x[0, 0] = float("inf")
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        assert not mon.step_applied
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert sched.last_epoch == 0 and sched.get_last_lr() == [0.1]
