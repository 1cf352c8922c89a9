"""Intentional -inf (a causal mask built by one module, added to the scores by another) is one
notion for the first non-finite's replay, the backward blame and the verdicts (issue 28 item 8),
and a custom autograd Function's backward is named with its own line (item 9)."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from torch import nn

import ampaudit

HERE = __file__


def _line_of(fn, text: str) -> str:
    lines, start = inspect.getsourcelines(fn)
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    return f"{HERE}:{start + offset}"


class CausalMask(nn.Module):
    """nanoGPT-shaped: the mask is built from the input's shape; its output needs no gradient."""

    def forward(self, x):
        t = x.shape[1]
        return torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))


class AddMask(nn.Module):
    def forward(self, att, mask):
        return att + mask


class InfBackward(torch.autograd.Function):
    """Forward is the identity; backward overflows every step."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


class Attention(nn.Module):
    def __init__(self, d: int, boom: bool):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.add_mask = AddMask()
        self.boom = boom

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        att = self.add_mask(q @ k.transpose(-1, -2), mask)
        y = att.softmax(-1) @ v
        if self.boom:
            y = InfBackward.apply(y)  # the attention's own Function
        return y


class MaskedGPT(nn.Module):
    def __init__(self, boom: str = "", d: int = 8):
        super().__init__()
        self.emb = nn.Embedding(16, d)
        self.cmask = CausalMask()
        self.attn = Attention(d, boom == "attention")
        self.head = nn.Linear(d, 16)
        self.boom = boom

    def forward(self, idx):
        x = self.emb(idx)
        mask = self.cmask(x)
        x = x + self.attn(x, mask)
        if self.boom == "model":
            x = InfBackward.apply(x)  # the model's own code, between its modules
        return self.head(x)


def _run(model, steps: int = 4, **watch):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    idx = torch.randint(0, 16, (2, 5))
    with ampaudit.watch(model, optimizer=opt, dtype="float16", **watch) as mon:
        for _ in range(steps):
            loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
            opt.zero_grad()
            loss.backward()
            if torch.isfinite(loss):
                opt.step()
    return mon.summary()


@pytest.mark.parametrize("log", [False, True], ids=["device", "log"])
def test_a_mask_module_never_makes_amp605(tmp_path, log):
    torch.manual_seed(0)
    summary = _run(MaskedGPT(), log=str(tmp_path / "w.jsonl") if log else None)
    assert summary["first_nonfinite"] is None
    assert [f["code"] for f in summary["findings"] if f["code"] == "AMP605"] == []
    assert summary["layers"]["cmask"]["forward"]["neginf"] == 4 * 10  # counted, not judged
    assert summary["layers"]["attn.add_mask"]["forward"]["neginf"] == 4 * 2 * 10


def test_mask_entries_are_not_overflow_in_the_table():
    from rich.console import Console

    from ampaudit.watch.render import render_summary

    torch.manual_seed(0)
    console = Console(width=200, record=True)
    render_summary(_run(MaskedGPT(), steps=1), console)
    (row,) = [line for line in console.export_text().splitlines() if "│ cmask " in line]
    cells = [cell.strip() for cell in row.split("│")[1:-1]]
    assert cells[:4] == ["cmask", "forward", "0/0 (10 -inf)", "0"]  # overflow %: the mask is not


def test_an_overflow_between_modules_is_blamed_on_the_models_own_code():
    """The Function sits in the model's forward: the gradient arriving at attn's output is bad,
    and the mask module (whose input shares it) has no backward to blame."""
    torch.manual_seed(0)
    first = _run(MaskedGPT("model"), steps=1)["first_nonfinite"]
    assert first == {"step": 0, "module": "(model)", "phase": "backward", "tensor": "grad of attn's output",
                     "op": "InfBackwardBackward", "source": _line_of(MaskedGPT.forward, "InfBackward.apply"),
                     "note": "from InfBackward.apply"}


def test_a_custom_functions_backward_gets_its_own_line():
    torch.manual_seed(0)
    first = _run(MaskedGPT("attention"), steps=1)["first_nonfinite"]
    assert {k: first[k] for k in ("module", "phase", "op", "source")} == {
        "module": "attn", "phase": "backward", "op": "InfBackwardBackward",
        "source": _line_of(Attention.forward, "InfBackward.apply")}


class WeightBoom(nn.Linear):
    """Only its weight's gradient overflows: every activation and input gradient stays finite."""

    def forward(self, x):
        return nn.functional.linear(x, InfBackward.apply(self.weight), self.bias)


def test_a_parameter_only_overflow_beside_a_mask_module_is_reported_at_its_step():
    """Step 0 replays the mask module (and learns it is one) and finds nothing else bad among
    the events: the weight's gradient is still step 0's. Before: reported at step 1."""
    torch.manual_seed(0)
    model = MaskedGPT()
    model.head = WeightBoom(8, 16)
    first = _run(model, steps=2)["first_nonfinite"]
    assert {k: first[k] for k in ("step", "module", "phase", "tensor", "op")} == {
        "step": 0, "module": "head", "phase": "backward", "tensor": "grad of weight", "op": "InfBackwardBackward"}
    assert first["source"] == _line_of(WeightBoom.forward, "InfBackward.apply")


def test_a_step_boundary_worked_out_once_logs_as_if_worked_out_every_step(tmp_path, monkeypatch):
    # The boundary keeps a step's keys, modes and rows while its events repeat
    # (Monitor._step_shape): a run whose events change (a module only from step 2 on, eval
    # forwards recorded) and where a replay finds the mask modules at step 0 - which changes the
    # modes of step 1, whose events are the same, and where a NaN after the mask must be the
    # first - writes the same log, byte for byte, as with all of it worked out at every step.
    from ampaudit.watch.monitor import Monitor

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt, self.extra, self.branch, self.scale = MaskedGPT(), nn.Linear(16, 16), False, 1.0

        def forward(self, idx):
            out = self.gpt(idx) * self.scale
            return self.extra(out) if self.branch else out

    def run(log):
        torch.manual_seed(0)
        model = Branchy()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        idx = torch.randint(0, 16, (2, 5))
        with ampaudit.watch(model, optimizer=opt, log=log, eval=True) as mon:
            for step in range(5):
                model.branch = step >= 2
                with torch.no_grad():
                    model(idx)
                model.scale = float("nan") if step == 1 else 1.0  # after the mask, in the same step
                model(idx).sum().backward()
                opt.step()
                opt.zero_grad()
        return log.read_bytes(), mon.masks

    kept, masks = run(tmp_path / "kept.jsonl")
    worked_out = Monitor._step_shape

    def afresh(self):
        self._shape = None
        return worked_out(self)

    monkeypatch.setattr(Monitor, "_step_shape", afresh)
    assert run(tmp_path / "afresh.jsonl") == (kept, masks) and masks == {"gpt.cmask", "gpt.attn.add_mask"}
    records = [json.loads(line) for line in kept.splitlines()[1:-1]]
    assert [(r["step"], (r["first_nonfinite"] or {}).get("module")) for r in records][:3] == [
        (0, None), (1, "(model)"), (2, "gpt.emb")]
