"""A model whose output starts at exactly zero (DiT's adaLN-Zero last layer) and keeps its
rotary frequencies in a complex buffer (fixtures/models/dit_adaln_zero.py, shaped like minRF's
DiT-Llama and torchtitan's Llama): the output comparison says it measured nothing instead of
an error of 0, the training check trains toward a unit target, and the complex buffer is kept
as autocast keeps it."""

from __future__ import annotations

import json

import pytest
import torch

import ampaudit
from ampaudit.check.api import check
from ampaudit.convert.train_check import _target
from ampaudit.convert.verify import ZERO_REFERENCE
from ampaudit.graph.forward import ExampleInputs
from fixtures.models import dit_adaln_zero
from tests.conftest import model


@pytest.mark.parametrize("backend", ["fx", "modules"])
def test_an_all_zero_fp32_output_is_no_measure_of_the_conversion(backend):
    converted = ampaudit.convert(dit_adaln_zero.get_model(), dit_adaln_zero.example_inputs(), train_steps=0,
                                 backend=backend)
    assert converted.summary.error_before is None and converted.summary.error_after is None
    assert ZERO_REFERENCE in converted.summary.notes
    # the same model with its default init is measured as any other
    measured = ampaudit.convert(dit_adaln_zero.get_model(zero=False), dit_adaln_zero.example_inputs(),
                                train_steps=0, backend=backend)
    assert 0 < measured.summary.error_before <= 1e-2
    assert ZERO_REFERENCE not in measured.summary.notes


def test_without_verification_the_zero_output_is_said_too():
    converted = ampaudit.convert(dit_adaln_zero.get_model(), dit_adaln_zero.example_inputs(), verify=False)
    assert converted.summary.error_before is None
    assert ZERO_REFERENCE in converted.summary.notes


def test_the_training_check_trains_a_zero_output_toward_a_unit_target():
    net = dit_adaln_zero.get_model()
    target = _target(net, ExampleInputs.coerce(dit_adaln_zero.example_inputs(), "inputs"), False)
    assert target.shape == (2, 2, 8, 8) and 0.8 < float(target.std()) < 1.2  # was 1e-3: nothing to learn
    live = dit_adaln_zero.get_model(zero=False)
    other = _target(live, ExampleInputs.coerce(dit_adaln_zero.example_inputs(), "inputs"), False)
    with torch.no_grad():
        spread = float(live(*dit_adaln_zero.example_inputs()).std())
    assert 0.8 < float(other.std()) / spread < 1.2  # scaled to a live output's spread, as before


def test_a_complex_buffer_is_kept_complex_and_the_converted_model_matches_fp32():
    net = dit_adaln_zero.get_model(zero=False)
    x, t = dit_adaln_zero.example_inputs()
    converted = ampaudit.convert(net, (x, t), train_steps=0)
    assert converted.freqs.dtype == torch.complex64
    with torch.no_grad():
        want, got = net(x, t), converted(x, t).float()
    assert float((got - want).norm() / want.norm()) < 1e-2


def test_the_cli_exports_the_complex_buffer_and_says_the_comparison_measured_nothing(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("convert", model("dit_adaln_zero.py"), "-o", out, "--train-steps", "4")
    assert result.code == 0, result.err
    assert "error vs fp32 not measured" in " ".join(w for w in result.out.split() if w != "│")
    summary = json.loads((out / "plan.json").read_text())["summary"]
    assert summary["error_before"] is None and ZERO_REFERENCE in summary["notes"]
    assert len(summary["train"]["fp32"]) == 4
    from safetensors.torch import load_file

    assert load_file(out / "weights.safetensors")["freqs"].dtype == torch.complex64


def test_complex_views_of_rotary_embeddings_are_in_the_catalog():
    # view_as_complex / view_as_real (Meta's llama, minRF, torchtitan) were AMP102 "not in the op catalog"
    report = check(dit_adaln_zero.get_model(), example_inputs=dit_adaln_zero.example_inputs(), dtype=torch.float16)
    assert "AMP102" not in {f.rule for f in report.findings}
    kinds = {n.kind: n.precision.value for n in report.nodes if n.kind in ("view_as_complex", "view_as_real")}
    assert kinds == {"view_as_complex": "neutral", "view_as_real": "neutral"}
