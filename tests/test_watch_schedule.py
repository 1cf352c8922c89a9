"""``every`` > 1 counts each optimizer's steps (watch/schedule.py): under ``ampaudit run`` a GAN's
two optimizers each end a watched step, and both get recorded."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from torch import nn

from ampaudit.watch.schedule import EverySchedule

GAN = """
import torch
from torch import nn
torch.manual_seed(0)
D, G = nn.Linear(4, 1), nn.Linear(2, 4)
opt_d, opt_g = torch.optim.SGD(D.parameters(), lr=0.01), torch.optim.SGD(G.parameters(), lr=0.01)
for it in range(8):
    fake = G(torch.randn(8, 2))
    opt_d.zero_grad()
    (D(torch.randn(8, 4)).mean() - D(fake.detach()).mean()).backward()
    opt_d.step()
    opt_g.zero_grad()
    D(fake).mean().backward()
    opt_g.step()
print("trained")
"""


def _walk(schedule: EverySchedule, enders: list[str]) -> tuple[list[int], int]:
    """The steps recorded for a run whose steps were ended by ``enders``, and how many were
    armed (recorded) but dropped."""
    armed, logged, dropped = True, [], 0
    for step, ender in enumerate(enders):
        if armed and schedule.due(ender):
            logged.append(step)
        elif armed:
            dropped += 1
        schedule.ended(ender)
        armed = schedule.arm_next()
    return logged, dropped


def test_one_optimizer_records_every_nth_step():
    assert _walk(EverySchedule(3), ["opt"] * 10) == ([0, 3, 6, 9], 0)
    assert _walk(EverySchedule(1), ["opt"] * 4) == ([0, 1, 2, 3], 0)


def test_two_optimizers_taking_turns_are_both_recorded():
    logged, dropped = _walk(EverySchedule(2), ["d", "g"] * 8)
    assert logged == [0, 4, 5, 8, 9, 12, 13]  # the generator's steps (odd) from its second turn on
    assert dropped == 4  # armed for a discriminator's turn (3, 7, 11, 15), the generator stepped: dropped
    # WGAN's five critic steps a generator step: each optimizer's every 10th step
    enders = (["d"] * 5 + ["g"]) * 20
    logged, _ = _walk(EverySchedule(10), enders)
    assert {enders[s] for s in logged} == {"d", "g"}
    # its 10th step (step 65); its first (step 5) came before anything knew of it
    assert [s for s in logged if enders[s] == "g"] == [65]


@pytest.mark.parametrize("shape", ["sweep", "optimizer each step"])
def test_an_optimizer_made_anew_goes_on_from_the_dead_one_s_count(shape):
    """A sweep rebuilds its model and optimizer (every 10 steps here, a multiple of ``every``); a
    MAML-style loop builds an optimizer each step. The counts were kept by id(optimizer) for ever:
    a dead optimizer's count of 10 kept every later step armed - recorded, then dropped at its
    boundary (a 500-step sweep under ``--every 10``: 1.5x the per-step cost after the first
    trial) - and a new optimizer at a dead one's address took its count. A dead ender's count
    now goes to the next new one: every 5th step is recorded, and only those are armed."""
    from ampaudit.watch.monitor import Monitor

    torch.manual_seed(0)
    mon = Monitor(None, every=5).start()
    armed = []
    for step in range(30):
        if step % 10 == 0:
            model = nn.Linear(4, 1)
        if shape == "optimizer each step" or step % 10 == 0:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        armed.append(mon.recorder.logging)  # whether the next step is armed
        if step % 10 == 9:
            del model, opt
            gc.collect()
    mon.stop()
    assert armed == [(step + 1) % 5 == 0 for step in range(30)]
    assert mon.summary()["logged_steps"] == 6


def test_ampaudit_run_every_2_records_both_optimizers_of_a_gan(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gan.py").write_text(GAN)
    result = cli("run", "--every", "2", "--log", "w.jsonl", "gan.py")
    assert result.code == 0 and result.out == "trained\n"
    records = [r for r in map(json.loads, (tmp_path / "w.jsonl").read_text().splitlines()) if "step" in r]
    assert [r["step"] for r in records] == [0, 4, 5, 8, 9, 12, 13]
    params = {r["step"]: sorted(r["params"]) for r in records}  # each step: its optimizer's parameters
    assert params[0] == params[4] == params[8] == params[12] != params[5] == params[9] == params[13]


def test_a_generator_output_made_before_the_discriminator_steps_has_its_gradient_recorded(cli, tmp_path, monkeypatch):
    # G's output is made in the discriminator's step and gets its gradient in the generator's:
    # its hook outlives the discriminator's step's end (only leaves' hooks come off there)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gan.py").write_text(GAN)
    result = cli("run", "--log", "w.jsonl", "gan.py")
    assert result.code == 0
    records = [r for r in map(json.loads, (tmp_path / "w.jsonl").read_text().splitlines()) if "step" in r]
    generator = [sorted(r["layers"]["(model)"]) for r in records]  # G, the first module that ran
    assert generator[1::2] == [["backward"]] * 8 and generator[0::2] == [["forward"]] * 8


TWO_OPTIMIZERS_ONE_BACKWARD = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
matrices = torch.optim.SGD([model[0].weight, model[2].weight], lr=0.01, momentum=0.9)  # Muon's share
others = torch.optim.AdamW([model[0].bias, model[2].bias], lr=0.01)
for it in range(3):
    model(torch.randn(8, 4)).pow(2).mean().backward()
    for opt in (others, matrices):
        opt.step()
    model.zero_grad(set_to_none=True)
print("trained")
"""


def _table(text: str, title: str) -> str:
    return text[text.index(title):].split("\n\n")[0]


def test_the_summary_keeps_each_parameter_s_last_norm_when_two_optimizers_step(cli, tmp_path, monkeypatch):
    """Muon for the matrices and AdamW for the rest, both stepping after one backward
    (cifar10-airbench, modded-nanogpt, nanochat): each step holds only its optimizer's
    parameters, and the summary at exit left the 'last norm' of the other optimizer's blank
    where `ampaudit report` of the same log showed it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "two.py").write_text(TWO_OPTIMIZERS_ONE_BACKWARD)
    live = cli("run", "--log", "w.jsonl", "two.py")
    assert live.code == 0 and live.out == "trained\n"
    table = _table(live.err, "Parameter gradients")
    rows = [line for line in table.splitlines() if line.startswith("│ ")]
    assert [row.split()[1] for row in rows] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(row.split("│")[2].strip() for row in rows), table  # a norm in each row
    assert table == _table(cli("report", "w.jsonl").out, "Parameter gradients")
