"""graph/module_calls.py: submodules traced on their own are traced as they are called."""

from __future__ import annotations

import torch
from torch import nn

from ampaudit.graph.forward import ExampleInputs
from ampaudit.graph.module_calls import concrete_args, record_calls


class _Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.word = nn.Embedding(10, 4)
        self.kind = nn.Embedding(2, 4)

    def forward(self, ids, kinds=None, scale=1.0):
        out = self.word(ids) * scale
        return out if kinds is None else out + self.kind(kinds)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = _Embed()

    def forward(self, ids):
        return self.embed(ids, kinds=None, scale=2.0).sum()


def test_first_calls_are_recorded_with_their_non_tensor_arguments():
    ids = torch.tensor([[1, 2, 3]])
    calls = record_calls(_Model(), ExampleInputs((ids,)))
    assert set(calls) == {"", "embed", "embed.word"}  # embed.kind never ran
    assert torch.equal(calls["embed"].args[0], ids) and calls["embed"].kwargs == {"kinds": None, "scale": 2.0}
    assert concrete_args(_Model().embed, calls["embed"]) == {"kinds": None, "scale": 2.0}
    assert concrete_args(_Model(), calls[""]) is None  # tensors only


def test_a_child_traced_with_its_concrete_arguments_runs_where_the_parent_calls_it():
    from torch import fx

    model = _Model()
    calls = record_calls(model, ExampleInputs((torch.tensor([[1, 2, 3]]),)))
    traced = fx.symbolic_trace(model.embed, concrete_args=concrete_args(model.embed, calls["embed"]))
    ids = torch.tensor([[4, 5]])
    assert torch.equal(traced(ids, None, 2.0), model.embed(ids, kinds=None, scale=2.0))
