"""The model's own ``torch.autocast(..., enabled=False)`` (x-transformers' decorator on its
rotary embedding, a ``with`` block): the recorder marks what ran inside, and the graph audit's
autocast view casts nothing there - the einsum that makes the frequencies stays fp32, so their
cos and sin need no upcast. Before, each got AMP101 ("autocast leaves it in float16 here")."""

import torch

import ampaudit
from ampaudit.core.config import Config
from fixtures.models import autocast_off_rotary as rotary
from tests.conftest import line_of, model

FIXTURE = model("autocast_off_rotary.py")


def _amp101(net):
    report = ampaudit.check(net, rotary.example_inputs(), config=Config(fail_on="never"))
    assert report.target.trace == "recorder"
    return [(f.rule, f.line) for f in report.findings if f.rule == "AMP101"]


def test_no_upcast_is_asked_where_the_model_turns_autocast_off():
    methods = {name: getattr(torch.amp.autocast_mode.autocast, name) for name in ("__init__", "__enter__", "__exit__")}
    assert _amp101(rotary.get_model()) == []
    # the recording put torch.autocast back as it was
    assert {name: getattr(torch.amp.autocast_mode.autocast, name) for name in methods} == methods


def test_the_same_code_without_the_guards_is_reported():
    rotated = line_of(FIXTURE, "return t * freqs.cos() + rotate_half(t) * freqs.sin()")
    table = line_of(FIXTURE, "bias = scaled.sin().sum(-1)")
    assert _amp101(rotary.unguarded_model()) == [("AMP101", rotated)] * 4 + [("AMP101", table)]
