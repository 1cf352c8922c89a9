"""Where a non-finite value is born: the module, the phase, the op and the user's line -
forward and backward - and masked -inf attention that is not an error."""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import nn

import ampaudit
from ampaudit.watch.blame import Event, blame_backward
from ampaudit.watch.events import LOSS_MODULE
from ampaudit.watch.monitor import Monitor, NonFiniteError
from ampaudit.watch.provenance import (
    BAD,
    FINITE,
    MASKED,
    Call,
    GradSpec,
    autocast_state,
    replay_backward,
    replay_forward,
    tensor_state,
)
from tests.test_watch_masks import InfBackward

HERE = __file__


def _line_of(fn, text: str) -> str:
    """``file:line`` of the line of ``fn`` that contains ``text``."""
    lines, start = inspect.getsourcelines(fn)
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    return f"{HERE}:{start + offset}"


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)  # past 88.7 fp32 overflows


class Norm(nn.Module):
    """An RMS-style norm: at an all-zero row the forward is finite, the backward of sqrt is inf."""

    def forward(self, x):
        rms = x.pow(2).mean(-1, keepdim=True).sqrt()
        return x * rms


class MaskedAttention(nn.Module):
    def __init__(self, dim: int = 8, fully_masked_row: bool = False):
        super().__init__()
        self.qk = nn.Linear(dim, 2 * dim)
        self.mask = ScoreMask(fully_masked_row)
        self.softmax = nn.Softmax(-1)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        scores = self.mask(q @ k.transpose(-1, -2))
        return self.softmax(scores) @ x


class ScoreMask(nn.Module):
    def __init__(self, fully_masked_row: bool):
        super().__init__()
        self.fully_masked_row = fully_masked_row

    def forward(self, scores):
        t = scores.shape[-1]
        keep = torch.tril(torch.ones(t, t, dtype=torch.bool))
        if self.fully_masked_row:
            keep[0] = False  # a row with nothing to attend to: softmax of all -inf is NaN
        return scores.masked_fill(~keep, float("-inf"))


def _steps(model, batches, **watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampaudit.watch(model, optimizer=opt, **watch) as mon:
        for x in batches:
            loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return mon.summary()


def _batches(steps: int, bad: int | None = None, shape=(3, 4)):
    """Small batches; the one at step ``bad`` is large enough that exp overflows."""
    return [torch.full(shape, 500.0 if step == bad else 0.1) for step in range(steps)]


# -- the replays on their own -------------------------------------------------------------------

def test_tensor_state_tells_masks_from_overflow():
    assert tensor_state(torch.tensor([1.0, 2.0])) == FINITE
    assert tensor_state(torch.tensor([1.0, float("-inf")])) == MASKED
    assert tensor_state(torch.tensor([float("-inf"), float("inf")])) == BAD
    assert tensor_state(torch.tensor([float("nan")])) == BAD
    assert tensor_state(torch.tensor([1, 2])) == FINITE


def test_forward_replay_names_the_op_and_line():
    call = Call(Exp(), (torch.full((2, 3), 100.0),), {}, autocast_state())
    origin = replay_forward(call)
    assert (origin.op, f"{origin.file}:{origin.line}") == ("aten.exp", _line_of(Exp.forward, "torch.exp"))


def test_forward_replay_does_not_blame_the_mask():
    module = MaskedAttention(fully_masked_row=True)
    origin = replay_forward(Call(module, (torch.randn(1, 4, 8),), {}, autocast_state()))
    # masked_fill wrote the -inf on purpose; softmax over a row of -inf is where NaN is born
    assert (origin.op, f"{origin.file}:{origin.line}") == (
        "aten._softmax", _line_of(MaskedAttention.forward, "self.softmax("))  # the call into nn.Softmax
    assert origin.note is None


def test_backward_replay_names_the_autograd_node_and_forward_line():
    call = Call(Norm(), (torch.zeros(2, 4, requires_grad=True),), {}, autocast_state())
    origin = replay_backward(call, [GradSpec(0, [[0, 8]])])
    assert origin.op == "SqrtBackward0"
    assert f"{origin.file}:{origin.line}" == _line_of(Norm.forward, ".sqrt()")


def test_replays_leave_the_run_untouched():
    bn = nn.Sequential(nn.BatchNorm1d(4), nn.Dropout(0.5))
    bn.train()
    x = torch.randn(8, 4, requires_grad=True)
    stats = bn[0].running_mean.clone(), bn[0].running_var.clone(), bn[0].num_batches_tracked.clone()
    rng = torch.get_rng_state()
    replay_forward(Call(bn, (x,), {}, autocast_state()))
    replay_backward(Call(bn, (x,), {}, autocast_state()), [])
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(stats, (bn[0].running_mean, bn[0].running_var,
                                                          bn[0].num_batches_tracked), strict=True))
    assert bn[0].weight.grad is None and x.grad is None


def test_a_failing_replay_only_says_why():
    class Once(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = False

        def forward(self, x):
            if self.used:
                raise RuntimeError("called twice")
            self.used = True
            return x

    module = Once()
    module(torch.ones(1))
    origin = replay_forward(Call(module, (torch.ones(1),), {}, autocast_state()))
    assert origin.op is None and "RuntimeError: called twice" in origin.note


def test_blame_backward_takes_the_innermost_module_with_finite_incoming_gradients():
    events = [Event("head", "backward", "grad of output"),
              Event("head", "input grad", "grad of input[0]"),
              Event("block.proj", "backward", "grad of output"),  # same tensor as head's input
              Event("l1", "backward", "grad of output"),
              Event("block.proj", "input grad", "grad of input[0]"),  # born here
              Event("block", "backward", "grad of output"),
              Event("block", "input grad", "grad of input[0]"),
              Event("mask", "input grad", "grad of input[0]")]  # its output needs no gradient: no backward
    bad = [False, False, False, True, True, False, True, True]
    assert blame_backward(events, bad) == [4, 6]  # proj first; its parent block as the fallback
    # every bad gradient came in from outside the modules (the loss): no producer among them
    assert blame_backward(events[:2], [True, True]) == []


# -- end to end: the monitor ------------------------------------------------------------------------

def test_forward_nonfinite_names_the_op_and_line():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Exp(), nn.Linear(8, 2))
    first = _steps(model, _batches(4, bad=2))["first_nonfinite"]
    assert first == {"step": 2, "module": "1", "phase": "forward", "tensor": "output", "op": "aten.exp",
                     "source": _line_of(Exp.forward, "torch.exp")}


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_weight_already_non_finite_is_named_not_denied(value):
    # Every op that went non-finite read the weight, so no op made NaN/Inf out of finite inputs:
    # the note names the parameter, and does not say the module "stayed finite" (HF GPT-2 with
    # an inf in c_proj).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with torch.no_grad():
        model[1].weight[0, 0] = value
    first = _steps(model, _batches(1))["first_nonfinite"]
    assert first.pop("note") == ("its parameter weight already held NaN or Inf before this forward (an optimizer "
                                 "step, or a write to the weights)")
    # -inf in the weight is read by addmm, which makes +inf of it: that op, as well
    made = {"op": "aten.addmm"} if value == float("-inf") else {}  # in nn.Linear: no line of the user's
    assert first == {"step": 0, "module": "1", "phase": "forward", "tensor": "output", **made}


class _UpBlock(nn.Module):
    """Pytorch-UNet's ``Up`` with a scale that overflows, a BatchNorm after it: the forward's
    own BatchNorm writes the NaN batch's statistics into its running stats."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        x1 = self.up(x) * 1e38 * 1e38  # past float32's max
        return self.bn(x1)


def test_a_buffer_the_forward_itself_made_non_finite_is_not_said_to_have_held_it_before():
    """The replay runs after the forward, which left the BatchNorm's running_mean NaN: the
    note said that buffer "already held NaN or Inf before this forward", beside the op that
    made the inf - which it did not (it was finite until the forward's own BatchNorm ran)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _UpBlock())
    first = _steps(model, _batches(1))["first_nonfinite"]
    assert first == {"step": 0, "module": "1", "phase": "forward", "tensor": "output", "op": "aten.mul",
                     "source": _line_of(_UpBlock.forward, "* 1e38")}


def test_backward_nonfinite_names_the_module_node_and_line():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Norm(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()  # layer 0 outputs exactly 0: Norm's sqrt(0)
    first = _steps(model, _batches(1))["first_nonfinite"]
    assert first == {"step": 0, "module": "1", "phase": "backward", "tensor": "grad of input[0]",
                     "op": "SqrtBackward0", "source": _line_of(Norm.forward, ".sqrt()"), "note": "from sqrt"}


def test_a_weight_blown_up_in_fp16_is_blamed_on_its_module():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("l1", nn.Linear(8, 16, bias=False))
    model.add_module("proj", nn.Linear(16, 16, bias=False))  # its weight, blown up below
    model.add_module("head", nn.Linear(16, 4))
    with torch.no_grad():
        model.proj.weight.mul_(1e4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    x = torch.randn(4, 8) * 1e-6  # a small forward: only proj's backward overflows fp16
    with ampaudit.watch(model, optimizer=opt, scaler=scaler) as mon:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).sum()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    summary = mon.summary()
    first = summary["first_nonfinite"]
    assert {k: first[k] for k in ("step", "module", "phase", "tensor")} == {
        "step": 0, "module": "proj", "phase": "backward", "tensor": "grad of input[0]"}
    assert first["op"] in ("MmBackward0", "AddmmBackward0")
    assert summary["scaler"]["skipped_steps"] == [0]


def test_masked_minus_inf_attention_is_not_an_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), MaskedAttention())
    summary = _steps(model, [torch.randn(2, 5, 8)] * 2, inputs=True, stop_on_nonfinite=True)
    assert summary["first_nonfinite"] is None
    assert summary["layers"]["1.mask"]["forward"]["inf"] == 2 * 2 * 10  # counted, not blamed
    assert summary["layers"]["1.mask"]["forward"]["neginf"] == 2 * 2 * 10


def test_a_fully_masked_row_is_blamed_on_the_softmax():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), MaskedAttention(fully_masked_row=True))
    first = _steps(model, [torch.randn(2, 5, 8)])["first_nonfinite"]
    assert {k: first[k] for k in ("module", "phase", "op")} == {
        "module": "1.softmax", "phase": "forward", "op": "aten._softmax"}


def test_ignore_patterns_skip_modules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Exp(), nn.Linear(8, 2))
    first = _steps(model, _batches(1, bad=0), ignore=["1"])["first_nonfinite"]
    assert first["module"] == "2"  # the inf that Exp made, seen where it arrives


def test_kwargs_and_gradient_accumulation_replay_the_right_call():
    class Gate(nn.Module):
        def forward(self, x, *, scale):
            return torch.exp(x * scale)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.gate = nn.Linear(4, 4), Gate()

        def forward(self, x, scale):
            return self.gate(self.fc(x), scale=scale)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampaudit.watch(model, optimizer=opt) as mon:
        for micro, scale in enumerate([1.0, 1e4, 1.0]):  # three micro-batches, one step; the 2nd blows up
            model(torch.ones(2, 4) * (micro + 1), scale).sum().backward()
        opt.step()
    first = mon.summary()["first_nonfinite"]
    assert {k: first[k] for k in ("step", "module", "phase", "op")} == {
        "step": 0, "module": "gate", "phase": "forward", "op": "aten.exp"}


class NoisyBlock(nn.Module):
    """Dropout, BatchNorm and an exp that overflows on a batch of large inputs: a replay of it
    draws random numbers and updates running statistics."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        h = self.bn(nn.functional.dropout(x, 0.3, self.training))
        return torch.exp(h + x.abs().amax() / 50)


def test_watch_with_replays_keeps_training_bit_identical():
    def run(watched: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), NoisyBlock(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ctx = ampaudit.watch(model, optimizer=opt) if watched else None
        if ctx:
            ctx.start()
        for step in range(3):
            loss = model(torch.randn(6, 4) * (1e4 if step == 1 else 1)).nan_to_num().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if ctx:
            ctx.stop()
            assert ctx.summary()["first_nonfinite"]["op"] == "aten.exp"
        return [t.clone() for t in (*model.parameters(), *model.buffers())], torch.get_rng_state()

    (plain, rng_plain), (watched, rng_watched) = run(False), run(True)
    # bit for bit, NaN where NaN (the bad step put NaN in the weights)
    assert all(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
               for a, b in zip(plain, watched, strict=True))
    assert torch.equal(rng_plain, rng_watched)


def test_stop_message_names_the_op():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Exp(), nn.Linear(8, 2))
    with pytest.raises(NonFiniteError, match=r"aten\.exp at .*test_watch_provenance\.py:\d+"):
        _steps(model, _batches(1, bad=0), stop_on_nonfinite=True)


def test_provenance_off_keeps_no_calls():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Exp(), nn.Linear(8, 2))
    first = _steps(model, _batches(1, bad=0), provenance=False)["first_nonfinite"]
    assert first == {"step": 0, "module": "1", "phase": "forward", "tensor": "output"}


def test_torch_transformer_with_a_causal_mask_is_not_an_error():
    """torch's own nn.TransformerEncoder, given the -inf causal mask torch makes for it: the
    mask is the model's input, and a float mask of -inf is what torch asks for."""
    torch.manual_seed(0)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
            self.head = nn.Linear(16, 50)

        def forward(self, idx, mask):
            return self.head(self.enc(self.emb(idx), mask=mask, is_causal=True))

    model = LM()
    opt = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, 50, (2, 6))
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    with ampaudit.watch(model, optimizer=opt, inputs=True, stop_on_nonfinite=True) as mon:
        for _ in range(2):
            loss = nn.functional.cross_entropy(model(idx, mask).flatten(0, 1), idx.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    summary = mon.summary()
    assert summary["first_nonfinite"] is None
    # counted in the statistics (2 steps x 15 masked scores), never blamed
    assert summary["layers"]["(model)"]["input"]["neginf"] == 2 * 15


NORM_SCRIPT = '''
import torch
from torch import nn


class Norm(nn.Module):
    def forward(self, x):
        rms = x.pow(2).mean(-1, keepdim=True).sqrt()
        return x * rms


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), Norm(), nn.Linear(8, 2))
with torch.no_grad():
    model[0].weight.zero_()
    model[0].bias.zero_()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(3):
    loss = model(torch.ones(3, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


@pytest.mark.parametrize("provenance", [True, False])
def test_ampaudit_run_names_the_backward_op(tmp_path, provenance):
    import subprocess
    import sys

    from ampaudit.watch.summary import read_log
    from tests.conftest import ROOT

    script = tmp_path / "train.py"
    script.write_text(NORM_SCRIPT)
    log = tmp_path / "run.jsonl"
    proc = subprocess.run([sys.executable, "-m", "ampaudit", "run", "--log", str(log),
                           *([] if provenance else ["--no-provenance"]), str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first = read_log(log).summary()["first_nonfinite"]
    if provenance:
        assert first == {"step": 0, "module": "1", "phase": "backward", "tensor": "grad of input[0]",
                         "op": "SqrtBackward0", "source": f"{script}:8", "note": "from sqrt"}
        assert "SqrtBackward0" in proc.stderr  # the summary printed at the end says it too
    else:  # module level: where the bad gradient arrived
        assert first == {"step": 0, "module": "0", "phase": "backward", "tensor": "grad of output"}


# -- what real models showed (nanoGPT, transformers GPT-2/Llama/BERT/T5): each a small fixture ------

def test_a_gradient_that_overflows_to_minus_inf_is_not_a_mask():
    """Cross-entropy's largest gradients are negative: a loss scale too high makes -inf only. It
    was born in the loss, not in the last layer (whose replay would make its own overflow)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8).half(), torch.randint(0, 4, (16,))
    with ampaudit.watch(model, optimizer=opt) as mon:
        loss = nn.functional.cross_entropy(model(x).float(), y) * 2.0**21
        opt.zero_grad()
        loss.backward()
        opt.step()
    first = mon.summary()["first_nonfinite"]
    assert {k: first[k] for k in ("module", "phase", "tensor")} == {
        "module": "1", "phase": "backward", "tensor": "grad of output"}
    assert first["note"].startswith("it came into the model already non-finite: from the loss")
    assert "a log of 0" in first["note"]  # no GradScaler here: no loss scale to blame


def test_the_loss_scale_is_named_as_a_cause_only_where_a_gradscaler_scales_the_loss():
    """An fp32 run with no GradScaler was told its NaN came from "a loss scale too high" (the
    watch hunt on minGPT and minRF): the example now fits the run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    with ampaudit.watch(model, optimizer=opt, scaler=scaler) as mon:
        loss = nn.functional.cross_entropy(model(x), y) * 2.0**100
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    first = mon.summary()["first_nonfinite"]  # the loss is finite, the scaled one is not
    assert (first["module"], first["phase"]) == ("(loss)", "loss")
    assert first["note"].startswith("the scaled loss was non-finite: a loss scale too high for it")


@pytest.mark.parametrize("after", [nn.LayerNorm(8), nn.ReLU()], ids=["layernorm", "relu"])
def test_a_forward_overflow_to_minus_inf_is_found(after):
    """fp16 pre-activations past -65504 are -inf only; a ReLU after them hides them, a LayerNorm
    turns them into NaN. Either way the Linear is where they were born."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), after, nn.Linear(8, 1))
    with torch.no_grad():
        model[0].bias.fill_(-7e4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampaudit.watch(model, optimizer=opt) as mon:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(4, 8))
        opt.zero_grad()
        out.float().sum().backward()
        opt.step()
    first = mon.summary()["first_nonfinite"]
    assert {k: first[k] for k in ("module", "phase", "op")} == {
        "module": "0", "phase": "forward", "op": "aten._to_copy"}  # the bias itself does not fit fp16
    assert "overflowed to -inf" in first["note"]


class ManualAttention(nn.Module):
    """nanoGPT's manual path: q @ k in fp16 can overflow, and softmax makes NaN, in this
    module's own code, before its child (the dropout) sees anything."""

    def __init__(self):
        super().__init__()
        self.qk = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        q, k = self.qk(x).split(8, -1)
        att = (q @ k.transpose(-2, -1)) / 8**0.5
        att = att.masked_fill(torch.ones(4, 4).tril() == 0, float("-inf"))
        return self.drop(att.softmax(-1)) @ x


def test_a_nan_made_in_a_parents_own_code_is_blamed_on_the_parent():
    torch.manual_seed(0)
    model = nn.Sequential(ManualAttention(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].qk.weight.mul_(400)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampaudit.watch(model, optimizer=opt) as mon:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(2, 4, 8))
        opt.zero_grad()
        out.float().sum().backward()
        opt.step()
    first = mon.summary()["first_nonfinite"]
    assert {k: first[k] for k in ("module", "phase", "tensor", "op", "source")} == {
        "module": "0", "phase": "forward", "tensor": "output", "op": "aten.bmm",
        "source": _line_of(ManualAttention.forward, "q @ k")}


def test_a_tied_weights_gradient_is_blamed_on_the_use_that_overflowed():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.mid, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx):
            return self.head(self.mid(self.emb(idx)))

    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with ampaudit.watch(model, optimizer=opt) as mon:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randint(0, 16, (64, 64)))
        opt.zero_grad()
        (out.float().mean() * 2.0**26).backward()
        opt.step()
    first = mon.summary()["first_nonfinite"]
    assert {k: first[k] for k in ("module", "phase", "tensor", "op")} == {
        "module": "head", "phase": "backward", "tensor": "grad of weight", "op": "MmBackward0"}


def test_transformers_kv_cache_is_copied_for_the_replay():
    """GPT-2 keeps use_cache=True in training: every layer gets one DynamicCache. The replay
    works on a copy: it names the node, and the user's cache is left as it was."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, use_cache=True))
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    # init_scale too high: the backward overflows
    first, out = _one_scaled_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ids, 2.0**20)
    assert {k: first[k] for k in ("module", "phase", "tensor", "op")} == {
        "module": "transformer.h.1", "phase": "backward", "tensor": "grad of input[0]", "op": "AddBackward0"}
    assert "/transformers/models/gpt2/modeling_gpt2.py:" in first["source"]
    assert [layer.keys.shape[-2] for layer in out.past_key_values.layers] == [12, 12]


def test_unwritten_memory_is_never_the_op():
    """torch.empty's bytes may hold NaN patterns: not a value any op made (a replay once named
    aten.empty_like); an op writing into an out= buffer of such memory is still found."""
    class Buffers(nn.Module):
        def forward(self, x):
            scratch = torch.empty_like(x)
            scratch.view(torch.int32).fill_(0x7FC00000)  # NaN bits, as uninitialised memory may hold
            out = torch.empty_like(x)
            out.view(torch.int32).fill_(0x7FC00000)
            torch.exp(x * 100, out=out)
            return out

    origin = replay_forward(Call(Buffers(), (torch.full((2, 2), 5.0),), {}, autocast_state()))
    assert (origin.op, f"{origin.file}:{origin.line}") == ("aten.exp", _line_of(Buffers.forward, "torch.exp("))


def test_a_llama_at_a_huge_init_scale_is_blamed_on_the_logits_upcast_not_the_rotary_embedding():
    """transformers' Llama at init_scale=2**40: the loss's gradient overflows where the model's
    own code casts the fp16 logits to float for the loss. Before: blamed on model.rotary_emb, a
    module that only reads its input's shape (its output needs no gradient)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager"))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    first, _ = _one_scaled_step(model, torch.optim.SGD(model.parameters(), lr=0.0), ids, 2.0**40)
    assert {k: first[k] for k in ("module", "phase", "tensor", "op")} == {
        "module": "(model)", "phase": "backward", "tensor": "grad of lm_head's output", "op": "ToCopyBackward0"}
    file, line = first["source"].rsplit(":", 1)
    assert file.endswith("transformers/loss/loss_utils.py")
    assert ".float()" in Path(file).read_text().splitlines()[int(line) - 1]  # the upcast


class TwiceB(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.b(self.a(x))  # 8 x 300 x 0.5: finite
        return self.b(h)  # the second call overflows float16


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_an_op_inside_nn_linear_names_the_users_line_that_called_it(phase):
    """addmm runs inside torch's nn.Linear: the line is the user's call of the module - its
    second call here. Before: no line. Backward: 8 x 300 x 64 overflows float16 in the second
    call's input gradient, its forward (8 x 300 x 0.5, then the first call's 1e-3) stays finite."""
    torch.manual_seed(0)
    model = TwiceB()
    with torch.no_grad():
        model.b.weight.fill_(300.0)
        if phase == "backward":
            model.a.weight.fill_(1e-6)
            model.a.bias.fill_(1e-6)
            model.b.bias.fill_(-2e-3)  # the first call's output ~1e-3, the second's ~1.4
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with ampaudit.watch(model, optimizer=opt) as mon:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.ones(2, 4))
        opt.zero_grad()
        (out.float().sum() * (1.0 if phase == "forward" else 64.0)).backward()
        opt.step()
    first = mon.summary()["first_nonfinite"]
    assert (first["module"], first["phase"], first["op"]) == (
        ("b", "forward", "aten.addmm") if phase == "forward" else ("b", "backward", "AddmmBackward0")), first
    assert first["source"] == _line_of(TwiceB.forward, "return self.b(h)")


def _one_scaled_step(model, opt, ids, init_scale):
    """One watched fp16 step of a transformers LM with a GradScaler: (first_nonfinite, the output)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    with ampaudit.watch(model, optimizer=opt, scaler=scaler) as mon:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(input_ids=ids, labels=ids)
        opt.zero_grad()
        scaler.scale(out.loss).backward()
        scaler.step(opt)
        scaler.update()
    return mon.summary()["first_nonfinite"], out


@pytest.mark.parametrize("user_hook", [False, True])
def test_one_gradient_hook_serves_a_tensor_two_modules_share_unless_a_users_hook_sits_between(user_hook):
    # m[0]'s output is m[1]'s input: one watch hook records both gradient events; a hook of the
    # user's registered between them (here: one that makes the gradient NaN) runs between them
    # as it would with a hook each - m[0]'s event sees the gradient before it, m[1]'s after
    from ampaudit.watch import stats
    from ampaudit.watch.events import INPUT_GRAD

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shared = []
    with ampaudit.watch(model, optimizer=opt) as mon:
        def keep(module, args, out):  # registered after watch's hook: runs after it
            shared.append(out)
            if user_hook:
                out.register_hook(lambda g: g * float("nan"))

        model[0].register_forward_hook(keep)
        model(torch.randn(3, 4, requires_grad=True)).sum().backward()
        assert len(shared[0]._backward_hooks) == (3 if user_hook else 1)
        recorder = mon.recorder
        wanted = {("0", "backward", "grad of output"): None, ("1", INPUT_GRAD, "grad of input[0]"): None}
        for event, row in zip(recorder.events, recorder.event_rows, strict=True):
            if event in wanted:
                raw = stats.raw_matrix(*recorder.arena.matrix([row], torch.device("cpu")))
                wanted[event] = bool(stats.nonfinite(raw).item())
        opt.step()
    assert list(wanted.values()) == [False, user_hook]


class _OnceInf(torch.autograd.Function):
    """Its backward makes inf on its first call only: what depends on state (or on exact
    gradient values a replay's synthetic ones do not have) is not made again by a replay."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _OnceInf.calls += 1
        return grad * float("inf") if _OnceInf.calls == 1 else grad


class _BetweenModules(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(_OnceInf.apply(self.a(x)))


def test_a_gradient_made_between_modules_that_a_replay_does_not_make_again_is_not_blamed_on_the_loss():
    """A gradient that went bad in the model's own code, between `b` and `a`, with a finite
    gradient coming into the model: when the replay of that code stayed finite (fp16 overflow
    of `h * exp(h.amax())` with real gradients, not with synthetic ones; a state-dependent
    backward), the blame said "it came into the model already non-finite: from the loss"."""
    _OnceInf.calls = 0
    model = _BetweenModules()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with ampaudit.watch(model, optimizer=opt) as mon:
        model(torch.ones(3, 4)).pow(2).mean().backward()
        opt.step()
    first = mon.summary()["first_nonfinite"]
    assert {k: first[k] for k in ("module", "phase", "tensor")} == {
        "module": "a", "phase": "backward", "tensor": "grad of output"}
    assert "from the loss" not in first["note"]
    assert first["note"].startswith("it was made between modules, in the code of `(model)`")


class _GraphConv(nn.Module):
    """pytorch/examples' gcn: sparse node features times a weight, then the sparse adjacency."""

    def __init__(self):
        super().__init__()
        self.kernel = nn.Parameter(torch.full((4, 3), 0.5))

    def forward(self, x, adj):
        return torch.spmm(adj, torch.mm(x, self.kernel))


def test_a_sparse_input_holding_inf_is_an_input_not_the_op_that_read_it():
    """A sparse batch holding inf: the op that read it was named as having made it ("aten.mm"),
    its sparse inputs taken for finite."""
    model = _GraphConv()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.eye(5, 4)
    x[2, 1] = float("inf")
    with ampaudit.watch(model, optimizer=opt) as mon:
        model(x.to_sparse(), torch.eye(5).to_sparse()).sum().backward()
        opt.step()
    first = mon.summary()["first_nonfinite"]
    assert (first["module"], first["phase"], first.get("op")) == ("(model)", "forward", None)
    assert first["note"].startswith("its inputs already held NaN or +inf")


# -- which forwards start a new micro-batch (whose predecessors' calls are released) ---------------

class _BoomAfter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 4)

    def forward(self, x):
        return InfBackward.apply(self.fc(x))  # the op the blame names, in this module's own code


def _run_mode(step) -> dict:
    """``step(opt_factory)`` under ``ampaudit run``'s watch (global hooks, every module called
    outside another a root); its first non-finite value."""
    from ampaudit.watch.monitor import Monitor

    opts = []

    def optimizer(params):
        opts.append(torch.optim.SGD(params, lr=0.01))
        return opts[-1]

    mon = Monitor(None, optimizer=None).start()
    try:
        step(optimizer)
    finally:
        mon.stop()
    return mon.summary()["first_nonfinite"]


def test_ampaudit_run_with_a_loss_module_names_the_backward_op():
    # the criterion module is a root of its own: its forward is the same micro-batch's, and the
    # model's calls stay for the replay (they were released: "the call was released")
    torch.manual_seed(0)
    model, criterion = nn.Sequential(nn.Linear(2, 2), _BoomAfter()), nn.MSELoss()

    def step(optimizer):
        opt = optimizer(model.parameters())
        criterion(model(torch.randn(8, 2)), torch.zeros(8, 4)).backward()
        opt.step()

    first = _run_mode(step)
    assert {k: first.get(k) for k in ("module", "phase", "op")} == {"module": "1", "phase": "backward",
                                                                     "op": "InfBackwardBackward"}


def test_a_second_forward_before_the_backward_keeps_the_first_s_calls():
    # a siamese pair: two forwards of the model, one backward - the first call's backward
    # overflows (an all-zero row into the norm), and its call is still there to replay
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), Norm(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampaudit.watch(model, optimizer=opt) as mon:
        (model(torch.zeros(3, 4)).sum() + model(torch.ones(3, 4)).sum()).backward()
        opt.step()
    first = mon.summary()["first_nonfinite"]
    assert {k: first.get(k) for k in ("module", "phase", "op")} == {"module": "1", "phase": "backward",
                                                                     "op": "SqrtBackward0"}


def test_a_checkpointed_block_run_again_in_the_backward_is_no_new_micro_batch():
    # ampaudit run: the block, recomputed inside the backward, is called outside any other
    # module - a root - after gradient hooks ran; the calls stay for the overflow made after it
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.block = nn.Linear(2, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh())

        def forward(self, x):
            h = InfBackward.apply(self.fc(x))  # its backward runs after the block's recomputation
            return checkpoint(self.block, h, use_reentrant=False)

    torch.manual_seed(0)
    model = Net()

    def step(optimizer):
        opt = optimizer(model.parameters())
        model(torch.randn(8, 2)).pow(2).mean().backward()
        opt.step()

    first = _run_mode(step)
    assert first.get("op") == "InfBackwardBackward", first


def test_a_gradient_whose_forward_ran_before_the_last_step_says_so():
    # a GAN: the generator's output is made before the discriminator's step and gets its
    # gradient in the generator's - that forward's calls went with the earlier step
    torch.manual_seed(0)
    gen, disc = _BoomAfter(), nn.Linear(4, 1)

    def step(optimizer):
        opt_d, opt_g = optimizer(disc.parameters()), optimizer(gen.parameters())
        fake = gen(torch.randn(8, 2))
        (disc(torch.randn(8, 4)).mean() - disc(fake.detach()).mean()).backward()
        opt_d.step()
        disc(fake).mean().backward()
        opt_g.step()

    first = _run_mode(step)
    assert (first["step"], first["phase"]) == (1, "backward")
    assert first["note"].startswith("its forward ran before the previous step ended")


# a single step: the probe, armed by it, had no later step to name it at; the note says how to
_LOSS_ITSELF = ("the loss was non-finite, made by the loop's code outside every watched module; its gradients made "
                "the model's non-finite too (to name its line where it does not happen again: `ampaudit run "
                "--probe-loss`, watch(probe_loss=True))")
# a term whose value is NaN (a sqrt of a negative) makes the loss NaN; one whose value is finite and
# whose gradient is not (a sqrt at exactly 0: 0 with an infinite slope) makes only the gradient bad
_NAN_TERM, _GRAD_TERM = "nan", "grad"


def _sqrt_term(t: torch.Tensor, term: str) -> torch.Tensor:
    return torch.sqrt(t.min()) if term == _NAN_TERM else torch.sqrt(t.min() - t.min().detach())


@pytest.mark.parametrize("term", [_NAN_TERM, _GRAD_TERM])
def test_a_loss_term_outside_the_modules_is_not_blamed_on_the_criterion_module_beside_it(term):
    """Pytorch-UNet's loop shape under ``ampaudit run``: ``loss = criterion(out, y)`` (an
    nn.CrossEntropyLoss, a watched module) plus a term the loop computes from the model's output.
    A NaN term makes the loss itself NaN: the loss is named. A term whose gradient alone is bad:
    the model's output gradient is the sum over both uses, and a tensor hook sees only the sum -
    the criterion, whose incoming gradient was finite and whose input's was not, was blamed ("the
    replay's gradients stayed finite"). Its replay clears it: the gradient came into the model's
    output from the loop's own code."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    criterion = nn.CrossEntropyLoss()

    def train(optimizer):
        opt = optimizer(model.parameters())
        for _ in range(2):
            out = model(torch.randn(5, 4))
            loss = criterion(out, torch.randint(0, 3, (5,))) + 0.01 * _sqrt_term(out, term)
            opt.zero_grad()
            loss.backward()
            opt.step()

    first = _run_mode(train)
    where = (first["module"], first["phase"], first["tensor"], first["step"])
    if term == _NAN_TERM:
        assert (where, first["note"]) == ((LOSS_MODULE, "loss", "loss", 0), _LOSS_ITSELF), first
        return
    assert where == ("(model)", "backward", "grad of output", 0), first
    assert first["note"] == (
        "it came into `(model)`'s output already non-finite, from code outside the watched modules that uses that "
        "output (a term of the loss, say): `CrossEntropyLoss`, which uses it too, made no NaN or Inf when its "
        "backward was replayed"), first

class _LogHead(nn.Module):
    """Pytorch-UNet's ``OutConv`` with a log in its own code: log(0) after a ReLU is -inf, its
    conv's output NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Linear(8, 3)

    def forward(self, x):
        return self.conv(torch.log(x))


@pytest.mark.parametrize("mode", ["watch", "run"])
def test_a_disabled_grad_scaler_ends_the_step_before_the_update_that_the_replay_must_not_see(mode):
    """``GradScaler(enabled=amp)`` with amp off (Pytorch-UNet's default): its update() ended the
    step, after optimizer.step() had written this step's NaN gradients into the weights, so the
    replay ran on them - "its parameter conv.weight already held NaN or Inf before this forward",
    at step 0. A disabled scaler's step is the optimizer's: the step ends before the update."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), _LogHead())
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def train(optimizer):
        opt = optimizer(model.parameters())
        for _ in range(2):
            loss = model(torch.randn(5, 4)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return opt

    if mode == "run":
        first = _run_mode(train)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with ampaudit.watch(model, optimizer=opt, scaler=scaler) as mon:
            train(lambda params: opt)
        first = mon.summary()["first_nonfinite"]
        assert mon.summary()["steps"] == 2
    assert first == {"step": 0, "module": "4", "phase": "forward", "tensor": "output", "op": "aten.log",
                     "source": _line_of(_LogHead.forward, "torch.log"),
                     "note": "it made -inf by arithmetic (not a mask, which masked_fill/where would write), which "
                             "`4.conv` turned into NaN or Inf"}, first


class _LogitsAndLoss(nn.Module):
    """nanoGPT's GPT in two layers: it returns its logits and the loss it computes from them."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.lm_head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x, y):
        logits = self.lm_head(torch.relu(self.body(x)))
        return logits, nn.functional.cross_entropy(logits, y)


@pytest.mark.parametrize("term", [_NAN_TERM, _GRAD_TERM])
def test_a_term_the_loop_adds_from_the_models_logits_is_not_said_to_come_from_finite_gradients(term):
    """build-nanogpt's loop with ``loss + sqrt(...)`` of the logits. A NaN term: the loss is named.
    A term whose gradient alone is bad: the logits' gradient arrives bad beside the loss's finite
    one; the replay of the model (that output seeded with zeros) stayed finite, and the note said it
    was made in the model's own code "(the gradients that came into it were finite)" - one was not.
    It names both places it can have come from."""
    torch.manual_seed(0)
    model = _LogitsAndLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampaudit.watch(model, optimizer=opt) as mon:
        for _ in range(2):
            logits, loss = model(torch.randn(5, 4), torch.randint(0, 3, (5,)))
            loss = loss + _sqrt_term(logits, term)
            opt.zero_grad()
            loss.backward()
            opt.step()
    first = mon.summary()["first_nonfinite"]
    where = (first["module"], first["phase"], first["tensor"], first["step"])
    if term == _NAN_TERM:
        assert (where, first["note"]) == ((LOSS_MODULE, "loss", "loss", 0), _LOSS_ITSELF), first
        return
    assert where == ("lm_head", "backward", "grad of output", 0), first
    assert first["note"] == (
        "it came into `(model)`'s output already non-finite: from code outside the watched modules that uses that "
        "output (a term of the loss, say), or from `(model)`'s own code after it, which stayed finite when "
        "replayed from the other outputs' gradients"), first

def test_a_gradient_made_non_finite_after_the_backward_says_no_modules_backward_made_it():
    """minGPT's trainer shape with the gradients divided by a zero norm between backward() and
    step(): every module's gradient was finite, the parameters' were not. The record named the
    first parameter and nothing else; it now says that no module's backward, replayed, made it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampaudit.watch(model, optimizer=opt) as mon:
        for _ in range(2):
            loss = model(torch.randn(3, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                p.grad.div_(p.grad[:0].norm())  # a norm over nothing: 0
            opt.step()
    first = mon.summary()["first_nonfinite"]
    assert (first["module"], first["phase"], first["tensor"], first["step"]) == (
        "0.bias", "backward", "param grad", 0), first
    assert first["note"] == (
        "replayed, the backward of the module that holds it made no NaN or Inf: it went non-finite after the "
        "backward, in code that writes the gradients (a division, clipping, a hook), or from exact gradient "
        "values a replay does not have"), first


class _Counting(nn.Module):
    """A forward that counts its calls in a plain attribute (a warmup ramp), and goes NaN on its
    third: its replay is a fourth call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.seen: list[int] = []

    def forward(self, x):
        self.calls += 1
        self.seen.append(self.calls)
        if self.calls == 3:
            x = x.log()  # NaN where x < 0
        return self.lin(x) * min(1.0, self.calls / 10)


def _train_counting(steps: int, watched: bool) -> tuple[nn.Module, Monitor | None, list[float]]:
    """``steps`` GradScaler steps of a model whose first module is a ``_Counting``."""
    torch.manual_seed(0)
    model = nn.Sequential(_Counting(), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    losses = []
    monitor = ampaudit.watch(model, optimizer=opt, scaler=scaler) if watched else None
    with monitor if monitor is not None else nullcontext():
        for _ in range(steps):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    return model, monitor, losses


def _counting_run(watched: bool) -> tuple[list[float], int, list[int]]:
    model, _, losses = _train_counting(5, watched)
    return losses, model[0].calls, model[0].seen


def test_a_replay_leaves_the_module_s_attributes_as_the_training_had_them():
    """A replay runs the module's forward again: a forward that counts its calls in an attribute
    counted the replays too (3 -> 5 after step 2's two), and the training went on with another
    ramp - other losses than without watch from step 3 on. Every module's attributes under the
    replayed one come back as the forward left them, lists filled in place included."""
    plain = _counting_run(False)
    assert plain[1:] == (5, [1, 2, 3, 4, 5])
    assert str(_counting_run(True)) == str(plain)


def test_a_nan_an_enclosing_module_s_own_code_made_but_did_not_make_again_is_blamed_on_it():
    """`_Counting` makes the NaN in its own code (a log) before its Linear, on its third call only:
    the Linear's inputs held NaN, and the enclosing module's replay (a fourth call) stayed finite.
    The note said the inputs "came from outside the watched modules (the batch, or code between
    modules)"; the enclosing module's inputs were finite, so its own code is named."""
    _, monitor, _ = _train_counting(3, watched=True)
    first = monitor.summary()["first_nonfinite"]
    assert (first["module"], first["phase"], first["step"]) == ("0", "forward", 2)
    assert first["note"].startswith("`0.lin`'s inputs already held NaN or +inf, made by `0`'s own code")
    assert "outside the watched modules" not in first["note"]
