"""Module hooks registered once and switched off and on between recorded steps (watch/hook_set.py):
off, a module's hook dicts hold none of them (torch's fast path, no Python call); on again, each
hook is called as when it was registered - with its keyword arguments -, last, where a new
registration would put it."""

from __future__ import annotations

import json

import torch
from torch import nn

import ampaudit
from ampaudit.watch import hooks
from ampaudit.watch.hook_set import HookSet


def _hook_dicts(module: nn.Module) -> list[dict]:
    return [module._forward_hooks, module._forward_hooks_with_kwargs, module._forward_pre_hooks]


def test_off_takes_every_entry_out_and_on_puts_it_back_last():
    layer, calls = nn.Linear(2, 2), []
    layer.register_forward_hook(lambda m, a, out: calls.append("user, before"))
    ours = HookSet([layer.register_forward_hook(lambda m, a, kw, out: calls.append(f"ours {sorted(kw)}"),
                                                with_kwargs=True),
                    layer.register_forward_pre_hook(lambda m, a: calls.append("ours, pre"))])
    layer.register_forward_hook(lambda m, a, out: calls.append("user, after"))
    x = torch.ones(1, 2)

    layer(x)
    assert calls == ["ours, pre", "user, before", "ours []", "user, after"]

    ours.off()
    calls.clear()
    layer(x)
    assert calls == ["user, before", "user, after"]
    assert [len(d) for d in _hook_dicts(layer)] == [2, 0, 0]
    ours.off()  # twice: nothing more to take out
    assert [len(d) for d in _hook_dicts(layer)] == [2, 0, 0]

    ours.on()
    ours.on()  # twice: each entry once
    calls.clear()
    layer(x)
    assert calls == ["ours, pre", "user, before", "user, after", "ours []"]
    assert [len(d) for d in _hook_dicts(layer)] == [3, 1, 1]


def test_a_freed_module_is_skipped():
    layer = nn.Linear(2, 2)
    hooks = HookSet([layer.register_forward_hook(lambda m, a, out: None)])
    hooks.off()
    del layer
    hooks.on()  # its dicts went with it
    assert hooks.is_on


def test_every_3_hooks_the_modules_only_for_recorded_steps_and_leaves_none_behind(tmp_path, monkeypatch):
    # once torch.compile compiled a graph in the process (an earlier test's) the hooks stay on
    monkeypatch.setattr(hooks, "compiled_anything", lambda: False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    children = list(model)
    hooked = []
    log = tmp_path / "run.jsonl"
    with ampaudit.watch(model, optimizer=opt, every=3, log=str(log)):
        for _ in range(7):
            opt.zero_grad()
            model(torch.randn(5, 4)).square().mean().backward()
            opt.step()
            hooked.append(sum(len(m._forward_hooks) for m in children))
    # after step k the hooks are those of step k + 1: recorded are steps 0, 3 and 6
    assert hooked == [0, 0, 3, 0, 0, 3, 0]
    assert all(len(d) == 0 for m in model.modules() for d in _hook_dicts(m))
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"step"')]
    assert [record["step"] for record in records] == [0, 3, 6]
    # each recorded step saw every module forward and backward, as the first did
    for record in records:
        assert {name: sorted(phases) for name, phases in record["layers"].items()} == \
            {name: ["backward", "forward"] for name in ("(model)", "0", "1", "2")}
