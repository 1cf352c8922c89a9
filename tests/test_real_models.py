"""Real Hugging Face models from tiny configs (no weights): check completes, its fallback
sees what fx cannot, norms and softmax are classified right, and the report is stable."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("transformers", reason="the dev extra installs transformers for these tests")

from ampaudit.check.api import check_path
from ampaudit.core.config import Config
from tests.conftest import model

LAYERS = 2


def _check(name: str):
    return check_path(model(name), config=Config(fail_on="never"))


def _kinds(report, *kinds):
    counts = Counter((n.kind, n.precision.value) for n in report.nodes if n.kind in kinds)
    return dict(counts)


def _codes(report):
    return sorted({f.rule for f in report.findings})


@pytest.fixture(scope="module")
def reports():
    return {name: _check(f"hf_{name}.py") for name in ("gpt2", "bert", "t5", "llama")}


@pytest.mark.parametrize("name", ["gpt2", "bert", "t5", "llama"])
def test_check_completes_and_sees_every_layer(reports, name):
    report = reports[name]
    assert report.target.trace in ("fx", "recorder")
    if report.target.trace == "recorder":
        assert "AMP001" in _codes(report)  # says what fx could not see
    # Every op carries a line in the library's own modeling code, never inside torch.
    assert all("/torch/" not in n.file for n in report.nodes)
    assert any(f"modeling_{name}" in n.file for n in report.nodes)
    assert all(n.measured is not None for n in report.nodes if n.op.startswith("call_") and n.kind == "linear")
    assert report.summary()["errors"] == 0


def test_gpt2(reports):
    report = reports["gpt2"]
    assert _kinds(report, "layer_norm", "softmax", "cross_entropy") == {
        ("layer_norm", "fp32"): 2 * LAYERS + 1, ("softmax", "fp32"): LAYERS, ("cross_entropy", "fp32"): 1}
    # gelu_new computes x**3 in the input dtype (transformers/activations.py): flagged once per block.
    pow_warnings = [f for f in report.findings if f.rule == "AMP206"]
    assert len(pow_warnings) == LAYERS and all(f.file.endswith("activations.py") for f in pow_warnings)


def test_bert(reports):
    report = reports["bert"]
    assert _kinds(report, "layer_norm", "softmax") == {("layer_norm", "fp32"): 2 * LAYERS + 1,
                                                         ("softmax", "fp32"): LAYERS}
    assert _codes(report) == ["AMP001"] or _codes(report) == []


@pytest.mark.parametrize("name", ["t5", "llama"])
def test_rmsnorm_variance_is_upcast_so_not_flagged(reports, name):
    report = reports[name]
    norms = 2 * LAYERS + 1 if name == "llama" else 3 * LAYERS + 2 * LAYERS + 2  # T5: encoder + decoder blocks
    kinds = _kinds(report, "pow", "mean", "rsqrt", "softmax")
    assert kinds[("pow", "fp32")] == kinds[("mean", "fp32")] == kinds[("rsqrt", "fp32")] == norms
    assert "AMP209" not in _codes(report)  # T5LayerNorm / LlamaRMSNorm upcast to fp32 first


def test_rmsnorm_without_the_upcast_is_flagged(monkeypatch):
    import torch
    from transformers.models.llama import modeling_llama

    def forward(self, hidden_states):  # LlamaRMSNorm, minus the fp32 upcast
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)
    report = _check("hf_llama.py")
    flagged = [f for f in report.findings if f.rule == "AMP209"]
    assert len(flagged) == 2 * LAYERS + 1
    assert all(f.file == "tests/test_real_models.py" for f in flagged)


def test_report_is_stable(reports):
    again = _check("hf_gpt2.py")
    assert again.to_dict() == reports["gpt2"].to_dict()
