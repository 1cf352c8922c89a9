"""Second-order gradients under ``ampaudit run`` (and ``--probe-loss``) train exactly as under
python: every shape of ``torch.autograd.grad`` a script uses - batched gradients, autograd's
vectorized jacobian, a gradient penalty inside ``torch.compile`` - gives the same exit code,
output, warnings and weights."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PRELUDE = """
import sys, torch
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
x = torch.randn(16, 4, requires_grad=True)
"""
EPILOGUE = "print([round(v, 6) for p in m.parameters() for v in p.detach().flatten().tolist()][:12])\n"

BATCHED = """
for step in range(2):
    out = m(x)
    g, = torch.autograd.grad(out, x, torch.eye(16).unsqueeze(-1), create_graph=True, is_grads_batched=True)
    loss = out.pow(2).mean() + g.pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step(); print(loss.item(), tuple(g.shape))
"""

JACOBIAN = """
from torch.autograd.functional import hessian, jacobian
for step in range(2):
    J = jacobian(lambda t: m(t).sum(0), x, create_graph=True, vectorize=True)
    H = hessian(lambda t: m(t).sum(), x[:2], vectorize=True)
    loss = m(x).pow(2).mean() + J.pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step(); print(loss.item(), tuple(H.shape))
"""

COMPILED_PENALTY = """
def penalised(x):
    out = m(x)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.pow(2).mean() + g.pow(2).mean()
step_loss = torch.compile(penalised, backend="eager")
for step in range(2):
    loss = step_loss(x)
    opt.zero_grad(); loss.backward(); opt.step(); print(round(loss.item(), 6))
"""


def _script_stderr(err: str) -> str:
    """The script's own stderr: what comes before run's summary."""
    return err.split("╭─ ampaudit watch", 1)[0]


def _same_as_python(tmp_path, body: str, *run_options: str) -> None:
    (tmp_path / "s.py").write_text(PRELUDE + body + EPILOGUE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plain = subprocess.run([sys.executable, "s.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    watched = subprocess.run([sys.executable, "-m", "ampaudit", "run", "--log", "w.jsonl", *run_options, "s.py"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)
    assert (watched.returncode, watched.stdout) == (0, plain.stdout), watched.stderr
    assert _script_stderr(watched.stderr) == plain.stderr


@pytest.mark.parametrize("probe", [(), ("--probe-loss",)], ids=["run", "probe-loss"])
@pytest.mark.parametrize("body", [BATCHED, JACOBIAN], ids=["is_grads_batched", "vectorized-jacobian"])
def test_autograd_s_batched_gradients_train_as_under_python(tmp_path, body, probe):
    """A gradient hook got autograd's own batched gradient (``is_grads_batched``, a vectorized
    jacobian): no storage, and no torch.func level that said so - the hook read its data pointer
    and the script died with a RuntimeError."""
    _same_as_python(tmp_path, body, *probe)


@pytest.mark.parametrize("probe", [(), ("--probe-loss",)], ids=["run", "probe-loss"])
def test_a_gradient_penalty_inside_torch_compile_trains_as_under_python(tmp_path, probe):
    """dynamo traced the autograd.grad wrapper and the probe's module hooks: warnings about
    builtins it cannot trace (``get_ident``), and under --probe-loss a TypeError from a frame
    dynamo handed over."""
    _same_as_python(tmp_path, COMPILED_PENALTY, *probe)


def test_watch_of_a_model_counts_autograd_s_batched_gradients_as_unmeasured():
    """The same batched gradients under ``ampaudit.watch(model)``, in process: each gradient hook
    that autograd's own vmap hands a batched gradient counts it (``unmeasured["functorch"]``),
    the step's other rows are as without it, and the gradients are python's, bit for bit."""
    import torch
    from torch import nn

    import ampaudit

    def run(watched: bool) -> tuple[list[torch.Tensor], dict, dict]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(5, 3, requires_grad=True)
        mon = ampaudit.watch(model, optimizer=opt) if watched else None
        if mon is not None:
            mon.start()
        out = model(x)
        rows = torch.eye(out.numel()).reshape(out.numel(), *out.shape)
        (jac,) = torch.autograd.grad(out, x, rows, retain_graph=True, is_grads_batched=True)
        out.pow(2).mean().backward()
        opt.step()
        summary = {}
        if mon is not None:
            mon.stop()
            summary = mon.summary()
        return [jac, *(p.detach().clone() for p in model.parameters())], summary.get("unmeasured", {}), \
            summary.get("layers", {})

    plain, _, _ = run(False)
    watched, unmeasured, layers = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, watched, strict=True))
    # the batched backward reaches every gradient hook - four tensors, two events each - none
    # measured, each event counted; the plain backward's rows are all there
    # (x: the first Linear's and the model's input; each output: its module's and the next one's
    # input; the last Linear's output is the model's) - 8 events, all in the batched backward
    assert unmeasured == {"functorch": 8}
    assert layers["0"]["backward"]["numel"] == 5 * 4 and layers["2"]["forward"]["numel"] == 5 * 2
