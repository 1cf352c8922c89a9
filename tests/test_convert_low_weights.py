"""A model whose weights are already bf16 or fp16 (``from_pretrained(..., torch_dtype=torch.bfloat16)``,
``model.half()``) converts, in both backends, with and without an optimizer: fp32 weights and
masters are made from its low values, the model passed in stays as it was, and the summary says
so (for bf16 weights converted for fp16, with AMP103's warning). Before, the converted model
failed to run: "mixed dtype (CPU): expect parameter to have scalar type of Float"."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import ampaudit  # noqa: E402
from ampaudit.load.loader import load_target  # noqa: E402
from tests.conftest import model  # noqa: E402


def _gpt2(dtype: torch.dtype):
    loaded = load_target(model("hf_gpt2.py"))
    return loaded.model.to(dtype).eval(), loaded.inputs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("backend", ["fx", "modules"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_model_converts_trains_and_matches_its_fp32_copy(dtype, backend):
    net, inputs = _gpt2(dtype)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    if dtype == torch.bfloat16:  # (Adam's v underflows fp16: a step in pure fp16 would break the weights)
        net(**inputs.kwargs).loss.backward()
        optimizer.step()  # Adam's moments exist, in the model's dtype: moved to the fp32 weights as fp32
        optimizer.zero_grad()
    before = {name: t.clone() for name, t in net.state_dict().items()}
    fp32 = copy.deepcopy(net).float()  # what the low weights are, in fp32
    model_mp, opt_mp = ampaudit.convert(net, optimizer, example_inputs=inputs, backend=backend, train_steps=3)
    assert model_mp.summary.train["passed"]
    name = str(dtype).removeprefix("torch.")
    notes = " ".join(model_mp.summary.notes)
    assert f"the model's weights are {name}: converted from an fp32 copy" in notes
    assert ("AMP103: the weights are bfloat16 and this conversion is for float16" in notes) is (dtype == torch.bfloat16)
    assert {p.dtype for p in model_mp.parameters()} == {torch.float32}  # weights="fp32" (training)
    with torch.no_grad():
        out, ref = model_mp(**inputs.kwargs).logits, fp32(**inputs.kwargs).logits
    assert _rel(out, ref) < 1e-2
    opt_mp.zero_grad()
    opt_mp.backward(model_mp(**inputs.kwargs).loss)
    opt_mp.step()  # the optimizer built on the bf16 parameters now steps the fp32 ones
    assert {state["exp_avg"].dtype for state in opt_mp.optimizer.state.values()} == {torch.float32}
    assert any(not torch.equal(p, fp32.get_parameter(n)) for n, p in model_mp.named_parameters())
    assert all(t.dtype == dtype or not t.is_floating_point() for t in net.state_dict().values())
    assert all(torch.equal(before[k], t) for k, t in net.state_dict().items())  # the user's model untouched


@pytest.mark.parametrize("backend", ["fx", "modules"])
def test_a_bf16_model_converts_for_inference(backend):
    net, inputs = _gpt2(torch.bfloat16)
    model_mp = ampaudit.convert(net, inputs, backend=backend, dtype="bfloat16")
    assert not any("AMP103" in n for n in model_mp.summary.notes)  # bf16 weights, bf16 compute: no overflow risk
    with torch.no_grad():
        assert _rel(model_mp(**inputs.kwargs).logits, copy.deepcopy(net).float()(**inputs.kwargs).logits) < 5e-2


def test_cli_converts_a_bf16_model(cli, tmp_path):
    spec = f"{model('hf_gpt2.py')}:get_model().to(torch.bfloat16)"
    result = cli("convert", spec, "-o", tmp_path / "out", "--backend", "fx", "--train-steps", "2")
    assert result.code == 0, result.err
    text = " ".join(result.out.split())
    assert "the model's weights are bfloat16" in text and "AMP103" in text
    net, inputs = _gpt2(torch.bfloat16)
    applied = ampaudit.apply(net, tmp_path / "out")
    with torch.no_grad():
        assert _rel(applied(**inputs.kwargs).logits, copy.deepcopy(net).float()(**inputs.kwargs).logits) < 1e-2


@pytest.mark.parametrize("backend", ["fx", "modules"])
def test_low_precision_inputs_of_a_low_precision_model_convert(backend):
    # a bf16 Whisper checkpoint is fed bf16 log-mel features: the fp32 copy convert works on
    # raised "Input type (c10::BFloat16) and bias type (float) should be the same" (exit 2)
    from fixtures.models import conv_stride_encoder

    net = conv_stride_encoder.get_model().to(torch.bfloat16)
    (features,) = conv_stride_encoder.example_inputs()
    features = features.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    model_mp, _ = ampaudit.convert(net, optimizer, example_inputs=(features,), backend=backend, train_steps=3)
    assert model_mp.summary.train["passed"]
    with torch.no_grad():
        expected = ampaudit.convert(net, (features.float(),), backend=backend)(features.float())
        assert torch.allclose(model_mp(features.float()), expected)
