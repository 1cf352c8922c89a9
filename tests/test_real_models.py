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


# -- precision the model declares -----------------------------------------------------------------


def test_t5_keeps_wo_in_fp32_as_transformers_does(reports):
    # T5ForConditionalGeneration._keep_in_fp32_modules = ["wo"]: its feed-forward output
    # overflows fp16, so transformers loads it in fp32 when the model is loaded in float16.
    wo = [n for n in reports["t5"].nodes if n.kind == "linear" and n.module.endswith("DenseReluDense.wo")]
    assert len(wo) == 2 * LAYERS  # encoder and decoder blocks
    assert all(n.precision.value == "fp32" for n in wo)
    assert wo[0].reason.startswith("the model keeps this module in fp32 "
                                   "(T5ForConditionalGeneration._keep_in_fp32_modules names 'wo')")
    wi = [n for n in reports["t5"].nodes if n.kind == "linear" and n.module.endswith("DenseReluDense.wi")]
    assert wi and all(n.precision.value == "fp16" for n in wi)


def test_t5_in_bfloat16_keeps_nothing_in_fp32():
    # _keep_in_fp32_modules applies to float16 only (the strict variant to bfloat16 too).
    report = check_path(model("hf_t5.py"), config=Config(fail_on="never"), dtype="bfloat16")
    wo = [n for n in report.nodes if n.kind == "linear" and n.module.endswith("DenseReluDense.wo")]
    assert wo and all(n.precision.value == "fp16" for n in wo)


def test_bf16_pretrained_llama_warns_for_float16():
    import torch

    import ampaudit
    from fixtures.models import hf_llama

    torch.manual_seed(0)
    llama = hf_llama.get_model()
    llama.config.dtype = torch.bfloat16  # what the hub config of a bf16-pretrained checkpoint says
    report = ampaudit.check(llama, hf_llama.example_inputs(), config=Config(fail_on="never"))
    (finding,) = [f for f in report.findings if f.rule == "AMP103"]
    assert finding.severity.value == "warning" and finding.message.startswith("LlamaForCausalLM's config says")
    assert finding.file.endswith("modeling_llama.py")
    assert report.summary()["errors"] == 0


# -- more architectures -----------------------------------------------------------------------------

# What each reports besides AMP001 (fx cannot trace them; the recorder does): real hazards of
# the model as written, on its random weights.
EXPECTED = {
    # gelu_new computes x**3 in the input dtype (transformers/activations.py), as in GPT-2
    "gpt_neo": {"AMP206": LAYERS},
    # layer_scale_init_value=1e-6: at initialisation the residual branches flush to zero in a
    # model cast to float16 (under autocast the fp32 parameter promotes the product)
    "convnext": {"AMP302": 2},
    # logit_scale.exp() (exp of a learned scalar; CLIP clamps it in training, the model does
    # not) and _get_vector_norm's pow(2).sum() without an upcast, for text and image embeddings
    "clip": {"AMP204": 1, "AMP209": 2},
}


@pytest.mark.parametrize("name", ["mistral", "gemma", "qwen2", "gpt_neo", "bart", "mt5", "whisper", "vit",
                                  "convnext", "swin", "resnet", "clip", "mamba", "deberta_v2"])
def test_more_architectures_report_only_their_real_hazards(name):
    import torch

    import ampaudit
    from fixtures.models.hf_more import MODELS

    torch.manual_seed(0)
    build, inputs = MODELS[name]
    report = ampaudit.check(build(), inputs(), config=Config(fail_on="never"))
    counts = Counter(f.rule for f in report.findings if f.rule != "AMP001")
    assert dict(counts) == EXPECTED.get(name, {})
    assert report.summary()["errors"] == 0
    if name == "mt5":  # MT5 keeps wo in fp32 too
        wo = [n for n in report.nodes if n.kind == "linear" and n.module.endswith(".wo")]
        assert wo and all(n.precision.value == "fp32" for n in wo)


@pytest.mark.parametrize("spec", ["hf:gpt2", "hf:bert", "hf:llama", "hf:t5"])
def test_convert_hf_models_built_from_configs(spec):
    # None of them traces at the top level: their children are traced as the model calls them
    # (BERT's embeddings get token_type_ids=None, and the child is traced with None there:
    # traced with a tensor, the converted model would crash).
    import torch

    import ampaudit
    from ampaudit.load.loader import load_target

    loaded = load_target(spec)
    model_mp = ampaudit.convert(loaded.model, loaded.inputs)
    summary = model_mp.summary
    assert summary.error_after < 1e-2
    assert summary.ops_low > 0 and summary.param_bytes.get("float16", 0) > summary.param_bytes.get("float32", 0)
    with torch.no_grad():
        model_mp(*loaded.inputs.args, **loaded.inputs.kwargs)


def test_convert_keeps_t5s_declared_fp32_modules_in_fp32():
    import ampaudit
    from ampaudit.load.loader import load_target

    loaded = load_target("hf:t5")
    model_mp = ampaudit.convert(loaded.model, loaded.inputs)
    wo = [r for r in model_mp.plan if r["op"] == "call_module" and (r["module"] or "").endswith("DenseReluDense.wo")]
    assert len(wo) == 4 and {(r["compute"], r["rule"]) for r in wo} == {("float32", "declared")}
    assert "keeps encoder.block.0.layer.1.DenseReluDense.wo in fp32 (_keep_in_fp32_modules)" in wo[0]["reason"]
    assert {p.dtype for n, p in model_mp.named_parameters() if n.endswith("wo.weight")} == {__import__("torch").float32}


@pytest.mark.parametrize("weights", ["low", "auto"])
@pytest.mark.parametrize("spec", ["hf:gpt2", "hf:bert", "hf:llama", "hf:t5"])
def test_modules_backend_on_hf_models_trains_and_round_trips(spec, weights, tmp_path):
    # the whole model converted with its own forward: with weights="low" most parameters
    # stored in float16, with the training default ("auto": fp32 with an optimizer) all fp32;
    # the training check within 2%, and the pickle-free export applied to a fresh model gives
    # the same outputs
    import torch

    import ampaudit
    from ampaudit.convert.export import export
    from ampaudit.load.loader import load_target

    loaded = load_target(spec)
    optimizer = torch.optim.AdamW(loaded.model.parameters(), lr=1e-3)
    model_mp, _ = ampaudit.convert(loaded.model, optimizer, example_inputs=loaded.inputs, backend="modules",
                                   weights=weights)
    summary = model_mp.summary
    assert type(model_mp) is type(loaded.model) and summary.backend == "modules"
    assert summary.error_after < 1e-2 and summary.train["passed"]
    if weights == "low":
        assert summary.param_bytes["float16"] > summary.param_bytes.get("float32", 0)  # most weights low
    else:
        assert set(summary.param_bytes) == {"float32"} and summary.weights == "fp32"
    export(model_mp, tmp_path / "out", summary=summary.to_dict())
    applied = ampaudit.apply(load_target(spec).model, tmp_path / "out")
    with torch.no_grad():
        a = applied(*loaded.inputs.args, **loaded.inputs.kwargs)
        b = model_mp(*loaded.inputs.args, **loaded.inputs.kwargs)
    assert torch.equal(a.logits, b.logits)
