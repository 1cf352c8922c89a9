"""watch on a torch.compile'd model: by default the compiled graph is untouched (bit-identical,
no graph break) and only what runs outside it is recorded; with ``inside_compile=True`` every
module inside it gets its rows too, from an op in the graph - still no graph break, also with
``fullgraph=True``, under the user's module names."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampaudit
from ampaudit.watch import compiled
from ampaudit.watch.summary import read_log
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not compiled.SUPPORTED, reason="this torch has no effect tokens")


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.by = 1.0  # set to inf: the output goes non-finite

    def forward(self, x):
        return x * self.by


class TinyLM(nn.Module):
    """nanoGPT's shape in small: returns (logits, loss), so the logits' gradient is never made."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, 16)
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 32)
        self.head = nn.Linear(32, 32)
        self.scale = Scale()

    def forward(self, idx, targets):
        h = F.gelu(self.fc(self.ln(self.emb(idx))))
        logits = self.scale(self.head(h))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _run(backend: str, *, watched: bool, inside: bool = False, steps: int = 3, fullgraph: bool = True,
         blowup_at: int | None = None):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = TinyLM()
    net = torch.compile(model, backend=backend, fullgraph=fullgraph)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 32, (4, 8), generator=gen)
    mon = ampaudit.watch(net, optimizer=opt, inside_compile=inside) if watched else None
    if mon:
        mon.start()
    for step in range(steps):
        if step == blowup_at:
            model.scale.by = float("inf")
        _, loss = net(idx, idx.roll(1, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    if mon:
        mon.stop()
    params = [p.detach().clone() for p in model.parameters()]
    return mon, sum(counters["graph_break"].values()), params


MODULES = {"(model)", "emb", "ln", "fc", "head", "scale"}


@pytest.mark.parametrize("fullgraph", [False, True])
def test_inside_compile_records_every_module_with_no_graph_break_and_the_same_numbers(fullgraph):
    _, breaks, plain = _run("aot_eager", watched=False, fullgraph=fullgraph)
    mon, watched_breaks, params = _run("aot_eager", watched=True, inside=True, fullgraph=fullgraph)
    assert watched_breaks == breaks == 0
    assert all(torch.equal(a, b) for a, b in zip(plain, params, strict=True))  # aot_eager: bit-identical
    layers = mon.summary()["layers"]
    assert set(layers) == MODULES  # the user's names: no _orig_mod
    assert all(sorted(phases) == ["backward", "forward"] for phases in layers.values())
    eager = ampaudit.watch(model := TinyLM(), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    with eager:
        gen = torch.Generator().manual_seed(1)
        idx = torch.randint(0, 32, (4, 8), generator=gen)
        opt = eager.optimizer
        for _ in range(3):
            _, loss = model(idx, idx.roll(1, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    uncompiled = eager.summary()["layers"]
    for module in MODULES:  # the same tensors, counted the same, as without compile
        for phase, stats in layers[module].items():
            if (module, phase) == ("(model)", "backward"):
                # the logits' gradient: made inside the graph, it never reaches the graph's output
                assert stats["numel"] == 3 and uncompiled[module][phase]["numel"] == 3 + 3 * 4 * 8 * 32
                continue
            want = uncompiled[module][phase]
            assert {k: stats[k] for k in ("numel", "nan", "inf", "zero")} == {k: want[k] for k in ("numel", "nan",
                                                                                              "inf", "zero")}
            assert stats["absmax"] == pytest.approx(want["absmax"], rel=1e-5)


def test_a_nan_inside_the_compiled_graph_is_found_in_its_module():
    mon, breaks, _ = _run("aot_eager", watched=True, inside=True, blowup_at=1)
    first = mon.summary()["first_nonfinite"]
    assert breaks == 0
    assert (first["step"], first["module"], first["phase"]) == (1, "scale", "forward")
    assert first["note"] == "it ran inside torch.compile, where calls are not kept for a replay"


@pytest.mark.slow  # inductor compiles C++ for the CPU: the real compiler, end to end
def test_by_default_the_compiled_graph_is_untouched_under_inductor():
    # A model whose graph returns an output no loss uses (its gradient hook gets None).
    _, breaks, plain = _run("inductor", watched=False, steps=2)
    mon, watched_breaks, params = _run("inductor", watched=True, steps=2)
    assert watched_breaks == breaks == 0
    assert all(torch.equal(a, b) for a, b in zip(plain, params, strict=True))
    assert set(mon.summary()["layers"]) == {"(model)"}


@pytest.mark.slow  # inductor compiles C++ for the CPU: the real compiler, end to end
def test_inside_compile_under_inductor_changes_only_the_last_bits():
    # A recorded tensor must be in memory: inductor may fuse, and so add up, differently.
    _, breaks, plain = _run("inductor", watched=False, steps=2)
    mon, watched_breaks, params = _run("inductor", watched=True, inside=True, steps=2)
    assert watched_breaks == breaks == 0
    assert set(mon.summary()["layers"]) == MODULES
    for a, b in zip(plain, params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _Unresumable(nn.Module):
    """A graph break inside try/finally: dynamo cannot resume the model's frame and runs it
    eagerly, compiling each function it calls (watch's hooks too) as a frame of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(4 + i, 5 + i) for i in range(4))

    def forward(self, x):
        try:
            for layer in self.layers:
                x = layer(x)
            torch._dynamo.graph_break()
        finally:
            pass
        return x


def _layers_after_two_steps(model: nn.Module, net: nn.Module, inside: bool) -> dict:
    with ampaudit.watch(net, inside_compile=inside) as mon:
        for _ in range(2):
            net(torch.arange(8.0).reshape(2, 4)).sum().backward()
    return mon.summary()["layers"]


@pytest.mark.parametrize("inside", [False, True])
def test_a_model_dynamo_runs_eagerly_is_counted_once(inside):
    # Past the recompile limit the hooks run eagerly, on the compiled model's inner copy of the
    # root too (_orig_mod), which returns the root's output: it must be counted once. The
    # config's own patch (pytest 9.2's monkeypatch undoes a config option by deleting it).
    torch._dynamo.reset()
    model = _Unresumable()
    with torch._dynamo.config.patch(recompile_limit=2):
        layers = _layers_after_two_steps(model, torch.compile(model, backend="aot_eager"), inside)
    eager = _layers_after_two_steps(model, model, inside=False)
    assert layers["(model)"]["forward"]["numel"] == eager["(model)"]["forward"]["numel"] == 2 * 2 * 8
    for module, phases in layers.items():
        assert phases == eager[module]


COMPILED_SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
net = torch.compile(model, backend="aot_eager", fullgraph=True)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = net(torch.ones(2, 4)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("inside", [False, True])
def test_run_records_inside_a_compiled_script_when_asked(tmp_path, inside):
    # ampaudit run hooks every module globally: the traced global hook puts the recording op in
    # the graph too (a hook that returned first would leave --inside-compile recording nothing).
    script, log = tmp_path / "train.py", tmp_path / "watch.jsonl"
    script.write_text(COMPILED_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "ampaudit", "run", "--log", str(log),
                           *(["--inside-compile"] if inside else []), str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_log(log).summary()
    assert summary["steps"] == 3
    assert set(summary["layers"]) == ({"(model)", "0", "1", "2"} if inside else {"(model)"})
    if inside:  # 3 steps of 2 x 8 activations, counted once
        assert summary["layers"]["0"]["forward"]["numel"] == summary["layers"]["1"]["forward"]["numel"] == 3 * 16
        assert summary["layers"]["(model)"]["forward"]["numel"] == 3 * 2


def test_run_inside_compile_on_a_torch_without_effect_tokens_is_one_line(tmp_path, cli, monkeypatch):
    monkeypatch.setattr(compiled, "SUPPORTED", False)
    script = tmp_path / "train.py"
    script.write_text(COMPILED_SCRIPT)
    result = cli("run", "--inside-compile", "--log", tmp_path / "watch.jsonl", script)
    assert result.code == 2 and not (tmp_path / "watch.jsonl").exists()
    assert result.err.strip().splitlines() == [
        "ampaudit: error: --inside-compile needs torch's effect tokens, which this torch does not have: update "
        "torch, or run without it"]


@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_compiled_model_is_replayed_eagerly_and_the_run_goes_on(fullgraph):
    """The replay runs the compiled model's original module eagerly: it names the op and line,
    and never compiles. Before: a replay under its dispatch mode made dynamo skip the user's
    forward, so with fullgraph=True the next step raised Unsupported (a run plain python
    finishes); without fullgraph the note was torch's raw error, cut mid-path."""
    mon, breaks, _ = _run("aot_eager", watched=True, blowup_at=1, fullgraph=fullgraph)
    first = mon.summary()["first_nonfinite"]
    assert breaks == 0
    assert {k: first[k] for k in ("step", "module", "phase", "op")} == {
        "step": 1, "module": "(model)", "phase": "forward", "op": "aten.mul"}
    _, start = inspect.getsourcelines(Scale.forward)
    assert first["source"] == f"{__file__}:{start + 1}"
    assert "note" not in first


def test_a_failed_replay_says_why_in_one_line():
    from ampaudit.watch.provenance import _failed

    error = RuntimeError("torch.compile with fullgraph=True found no compiled frames. Skipped frames:\n"
                         "  - forward (/a/very/long/path/to/the/users/model.py:45): non-infra torch dispatch mode "
                         + "x" * 300)
    note = _failed(error)
    assert "\n" not in note and len(note) <= 200
    assert note == "replaying the module failed: RuntimeError: torch.compile with fullgraph=True found no compiled " \
                   "frames. Skipped frames:"


@pytest.mark.parametrize("model_given", [True, False])  # watch(model), and ampaudit run's global hooks
@pytest.mark.parametrize("compile_at", [0, 4])
def test_every_n_recompiles_a_graph_at_most_once(compile_at, model_given):
    # every=3 takes the module hooks off between recorded steps - except once torch.compile has
    # compiled a graph (its guards may check the hooks). Compiled from the start: one graph.
    # Compiled while the hooks were off (step 4): at most once more when they come back at step
    # 6 (the global hooks are guarded), then never again.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    graphs = []
    with ampaudit.watch(model if model_given else None, optimizer=opt if model_given else None, every=3) as mon:
        net = model
        for step in range(12):
            if step == compile_at:
                net = torch.compile(model, backend="eager")
            _, loss = net(idx, idx.roll(1, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[6 if compile_at else 0]  # none after the hooks came back on
    assert graphs[-1] <= (1 if compile_at == 0 else 2)
    assert mon.summary()["steps"] == 12


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def test_run_names_the_parameters_of_a_model_compiled_in_place():
    # model.compile() runs no module's hooks outside its graph, so ampaudit run's global hooks
    # never named it: its parameters were param0, param1, ... by the optimizer's order. A
    # model whose blocks alone are compiled names them within its own tree; a second model
    # compiled whole is a further root, named by its class.
    torch._dynamo.reset()
    whole, outer, critic = TinyLM(), Blocks(), nn.Sequential(nn.Linear(8, 1))
    opt = torch.optim.SGD([*whole.parameters(), *outer.parameters(), *critic.parameters()], lr=1e-2)
    idx = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    original = nn.Module.compile
    with ampaudit.watch(None) as mon:  # as ampaudit run watches the script, which compiles
        whole.compile(backend="eager")
        for block in outer.blocks:
            block.compile(backend="eager")
        critic.compile(backend="eager")
        for _ in range(2):
            whole(idx, idx.roll(1, 1))[1].backward()
            critic(outer(torch.ones(3, 4))).sum().backward()
            opt.step()
            opt.zero_grad()
    assert nn.Module.compile is original  # the run's wrapper is gone with it
    assert sorted(mon.summary()["params"]) == sorted([
        # the first model to run a forward outside a graph: its names unprefixed, its compiled blocks' too
        "inp.weight", "inp.bias", "blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias",
        "TinyLM.emb.weight", "TinyLM.ln.weight", "TinyLM.ln.bias", "TinyLM.fc.weight", "TinyLM.fc.bias",
        "TinyLM.head.weight", "TinyLM.head.bias", "Sequential.0.weight", "Sequential.0.bias"])


def test_run_names_a_model_compiled_in_place_as_the_model(tmp_path):
    # the one model of a script, compiled in place: named as if it ran outside a graph
    torch._dynamo.reset()
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    with ampaudit.watch(None, log=tmp_path / "w.jsonl") as mon:
        model.compile(backend="eager")
        model(idx, idx.roll(1, 1))[1].backward()
        opt.step()
    assert sorted(mon.summary()["params"]) == sorted(name for name, _ in model.named_parameters())
    assert sorted(read_log(tmp_path / "w.jsonl").summary()["params"]) == sorted(mon.summary()["params"])


def test_a_block_compiled_on_its_own_keeps_its_names():
    """``blocks[i] = torch.compile(block)`` puts torch.compile's wrapper inside the model: its
    parameters were reported as ``1._orig_mod.0.weight``, the names the model was written with
    only for a wrapper around the whole model. The wrapper's inner copy, like the root's, is not
    a module of its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    model[1] = torch.compile(model[1], backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampaudit.watch(model, optimizer=opt) as mon:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    summary = mon.summary()
    assert sorted(summary["params"]) == ["0.bias", "0.weight", "1.0.bias", "1.0.weight"]
    assert sorted(summary["layers"]) == ["(model)", "0", "1"]  # inside the compiled block: not recorded
