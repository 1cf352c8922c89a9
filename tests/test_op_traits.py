"""Op traits (rules/ops.toml [traits]) decide what the graph passes look through and measure."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import ampaudit
from ampaudit.core.catalog import builtin_catalog
from ampaudit.core.config import Config
from ampaudit.graph.kinds import node_kind
from ampaudit.graph.range_probe import MEASURED, probe

AMP208 = Config(select=["AMP208"], fail_on="never")

# Rearrangements the pattern rules look through (same_values): log of a relu output, moved.
REARRANGED = {
    "t": lambda r, x: r.t(),
    "movedim": lambda r, x: r.movedim(0, 1),
    "unflatten": lambda r, x: r.unflatten(1, (2, 4)),
    "view_as": lambda r, x: r.view_as(x),
    "reshape_as": lambda r, x: r.reshape_as(x),
    "transpose": lambda r, x: r.transpose(0, 1),
    "getitem": lambda r, x: r[0],
    "getattr": lambda r, x: r.T,
    "type_as": lambda r, x: r.type_as(x),
}


class _LogOfRelu(nn.Module):
    def __init__(self, move) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.move = move

    def forward(self, x):
        return torch.log(self.move(torch.relu(self.fc(x)), x))


@pytest.mark.parametrize("kind", sorted(REARRANGED))
def test_pattern_rules_see_through_every_rearrangement(kind: str) -> None:
    report = ampaudit.check(_LogOfRelu(REARRANGED[kind]), (torch.randn(4, 8),), config=AMP208, run=False)
    assert [(f.rule, f.node) for f in report.findings] == [("AMP208", "log")]


class _Shuffle(nn.Module):
    def forward(self, x):
        return x.flip(-1)


class _LogOfShuffledRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.shuffle = _Shuffle()

    def forward(self, x):
        return torch.log(self.shuffle(torch.relu(self.fc(x))))


def test_a_users_trait_reaches_the_pattern_rules() -> None:
    policy = {"ops": {"shuffle": {"precision": "neutral", "reason": "reorders channels"}},
              "modules": {"_Shuffle": "shuffle"}}
    x = (torch.randn(4, 8),)
    plain = ampaudit.check(_LogOfShuffledRelu(), x, policy=policy, config=AMP208, run=False)
    assert plain.findings == []  # the log's input comes from an op that moves nothing, as far as it knows
    policy["traits"] = {"same_values": {"ops": ["shuffle"]}}
    traited = ampaudit.check(_LogOfShuffledRelu(), x, policy=policy, config=AMP208, run=False)
    assert [f.rule for f in traited.findings] == ["AMP208"]


class _Broadcast(nn.Module):
    def forward(self, x, y):
        small = x * 3e-7  # float16 subnormals: the smallest flush to 0
        return small.unsqueeze(0).expand(3, -1, -1), small.expand_as(y)


def test_the_range_probe_copies_measurements_through_a_broadcast() -> None:
    gm = fx.symbolic_trace(_Broadcast())
    catalog = builtin_catalog()
    kinds = {n: node_kind(n, gm, catalog)[0] for n in gm.graph.nodes}
    probe(gm, torch.float16, kinds, (torch.linspace(-1, 1, 32).reshape(4, 8), torch.zeros(4, 8)), {})
    by_kind = {kinds[n]: n.meta[MEASURED] for n in gm.graph.nodes if MEASURED in n.meta}
    source = by_kind["mul"]
    assert source.rel_error and source.flush and source.subnormal  # the mul rounds: there is something to copy
    for kind, numel in (("expand", 3 * 32), ("expand_as", 32)):
        m = by_kind[kind]
        assert (m.numel, m.rel_error, m.bits_lost) == (numel, 0.0, 0)  # adds no error of its own
        assert (m.absmax, m.min_nonzero, m.overflow, m.flush, m.subnormal) == (
            source.absmax, source.min_nonzero, source.overflow, source.flush, source.subnormal)


class _Random(nn.Module):
    def forward(self, p):
        return torch.bernoulli(p) * 2.0


def test_random_ops_are_known_and_not_compared_across_runs() -> None:
    gm = fx.symbolic_trace(_Random())
    catalog = builtin_catalog()
    kinds = {n: node_kind(n, gm, catalog) for n in gm.graph.nodes}
    assert [k for k in kinds.values() if k[0] == "bernoulli"] == [("bernoulli", True)]
    probe(gm, torch.float16, {n: k[0] for n, k in kinds.items()}, (torch.full((64,), 0.5),), {}, catalog)
    (sample,) = [n for n in gm.graph.nodes if kinds[n][0] == "bernoulli"]
    assert sample.meta[MEASURED].rel_error is None
