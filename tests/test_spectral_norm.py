"""load/spectral_norm.py: a freshly built model under the old torch.nn.utils.spectral_norm is
measured as it trains, not as its random u and v make its eval forward
(fixtures/models/spectral_norm_discriminator.py); a converged one is left to the bit."""

from __future__ import annotations

import json

import torch

from ampaudit.load.loader import load_target
from ampaudit.load.spectral_norm import converge_spectral_norms
from tests.conftest import model

FIXTURE = model("spectral_norm_discriminator.py")


def _buffers(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in net.state_dict().items() if k.endswith(("_u", "_v"))}


def test_a_fresh_discriminator_is_measured_as_it_trains(cli):
    result = cli("check", FIXTURE, "--format", "json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["findings"] == []  # its eval forward at init: max |x| 2.5e5, an AMP301 error
    note = next(n for n in report["target"]["notes"] if n.startswith("spectral_norm on convs.0, convs.1, convs.2 "
                                                                         "and 3 more: u and v never iterated"))
    assert "15 power iterations first" in note
    loaded = load_target(FIXTURE)
    with torch.no_grad():
        assert float(loaded.model(*loaded.inputs.args).abs().max()) < 1.0  # as a training forward gives


def test_a_trained_discriminator_is_left_to_the_bit():
    net = load_target(f"{FIXTURE}:trained").model
    before = _buffers(net)
    assert len(before) == 12
    assert converge_spectral_norms(net) == []
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())


def test_convert_trains_a_fresh_discriminator(cli, tmp_path):
    result = cli("convert", FIXTURE, "--train-steps", "8", "-o", tmp_path / "out")
    assert result.code == 0, result.out
    assert "training check  8 steps: loss" in result.out
