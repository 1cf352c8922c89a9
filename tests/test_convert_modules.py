"""The modules backend on real models' idioms (issue 26, round 3): forwards called directly,
forwards that store attributes, and a plan that says what runs."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ampaudit
from fixtures.models import annotated_transformer, ddpm_unet, llama_meta, stored_attributes
from tests.conftest import model


def _relative_error(reference: torch.Tensor, value: torch.Tensor) -> float:
    return float((value.float() - reference).norm() / reference.norm())


def test_meta_llama_calling_submodule_forward_directly_converts_and_trains():
    # TransformerBlock calls self.attention.forward(...): no hook sees that call, and the fx
    # trace that fails first used to leave a Proxy in self.freqs_cis, which the recording run
    # then fed to reshape_for_broadcast's assert (TraceError)
    net = llama_meta.get_model()
    tokens, start_pos = llama_meta.example_inputs()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    model_mp, opt_mp = ampaudit.convert(net, optimizer, example_inputs=(tokens, start_pos), train_steps=3)
    assert model_mp.summary.backend == "modules" and model_mp.summary.train["passed"]
    # the ops of a forward called directly are its module's own
    softmax = [r for r in model_mp.plan if r["kind"] == "softmax"]
    assert [r["module"] for r in softmax] == ["layers.0.attention", "layers.1.attention"]
    assert {r["module"] for r in model_mp.plan if r["kind"] == "silu"} == {"layers.0.feed_forward",
                                                                           "layers.1.feed_forward"}
    with torch.no_grad():
        reference, converted = net(tokens, start_pos), model_mp(tokens, start_pos)
    assert converted.dtype == torch.float32 and _relative_error(reference, converted) < 1e-2
    losses = []
    for _ in range(3):  # and it trains with the returned optimizer
        loss = torch.nn.functional.cross_entropy(model_mp(tokens, start_pos).flatten(0, 1), tokens.flatten())
        opt_mp.zero_grad()
        opt_mp.backward(loss)
        opt_mp.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


def test_meta_llama_on_the_command_line(cli, tmp_path):
    result = cli("convert", model("llama_meta.py"), "-o", tmp_path / "out", "--train-steps", "3")
    assert result.code == 0, result.err
    assert "20 steps" not in result.out and "3 steps" in result.out
    check = cli("check", model("llama_meta.py"), "--format", "json")
    assert check.code == 0, check.err
    report = check.json()
    assert report["target"]["trace"] == "recorder"  # the same recording as convert's
    softmax = [n for n in report["nodes"] if n["kind"] == "softmax"]
    assert [n["module"] for n in softmax] == ["layers.0.attention", "layers.1.attention"]


def _attributes(net: torch.nn.Module) -> dict[str, dict[str, object]]:
    return {name: dict(m.__dict__) for name, m in net.named_modules()}


@pytest.mark.parametrize("backend", ["fx", "modules"])
@pytest.mark.parametrize("entry", ["get_model", "untraceable_model"])
def test_convert_leaves_attributes_a_forward_stores_as_they_were(backend, entry):
    # the Annotated Transformer keeps self.attn = p_attn: after convert's runs (trace, record,
    # range probe, verification, training check) that was a non-leaf (or float64, or Proxy)
    # tensor, and copy.deepcopy of the model raised
    net = getattr(stored_attributes, entry)()
    before = _attributes(net)
    inputs = stored_attributes.example_inputs()
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-2)
    model_mp, _ = ampaudit.convert(net, optimizer, example_inputs=inputs, backend=backend, train_steps=2)
    after = _attributes(net)
    assert after.keys() == before.keys()
    for name, attributes in before.items():
        assert after[name].keys() == attributes.keys(), name
        assert all(after[name][k] is v for k, v in attributes.items()), name
    assert net.self_attn.attn is None and net.decoder.steps == 0
    copy.deepcopy(net)
    copy.deepcopy(model_mp)
    if backend == "modules":  # the user's classes, whose own forward has not run since they were copied
        assert model_mp.self_attn.attn is None and model_mp.decoder.steps == 0
    net.eval(), model_mp.eval()
    with torch.no_grad():  # and both still run as before
        assert _relative_error(net(*inputs), model_mp(*inputs)) < 1e-2


class _AtenDtypes(TorchDispatchMode):
    """Each aten op that runs, with the dtype of its first tensor input."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None:
            self.ops.append((func.overloadpacket.__name__, first.dtype))
        return func(*args, **(kwargs or {}))


# the aten op each planned kind runs as (one per call in this model)
_ATEN = {"softmax": "_softmax", "normalize": "linalg_vector_norm", "exp": "exp", "sin": "sin", "cos": "cos",
         "einsum": "bmm", "conv2d": "convolution", "linear": "addmm"}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_every_planned_dtype_is_the_dtype_that_runs(device):
    # lucidrains' LinearAttention and Attend call softmax in a module with children: that
    # softmax was left to autocast, whose CPU fp16 policy runs it in float16 while the plan
    # (and the summary's count of fp32 ops) said float32
    net = ddpm_unet.get_model().to(device)
    inputs = tuple(t.to(device) for t in ddpm_unet.example_inputs())
    model_mp = ampaudit.convert(net, inputs, backend="modules")
    names = {"float16": torch.float16, "float32": torch.float32}
    planned = {kind: [names[r["compute"]] for r in model_mp.plan if r["kind"] == kind and r["op"].startswith("call_")]
               for kind in _ATEN}
    with torch.no_grad(), _AtenDtypes() as seen:
        model_mp(*inputs)
    for kind, aten in _ATEN.items():
        observed = [dtype for name, dtype in seen.ops if name == aten]
        assert planned[kind] and observed == planned[kind], kind
    assert planned["softmax"] == [torch.float32] * 7 and planned["einsum"] == [torch.float16] * 10


# the aten op each planned kind of the Annotated Transformer runs as (one per call)
_TRANSFORMER_ATEN = {"linear": "addmm", "matmul": "bmm", "masked_fill": "masked_fill", "softmax": "_softmax",
                     "mean": "mean", "std": "std", "embedding": "embedding"}


@pytest.mark.parametrize("backend", ["fx", "modules"])
def test_every_planned_op_of_the_annotated_transformer_runs_in_its_planned_dtype(backend):
    # every op the plan computes in a dtype, seen at the aten level on this CPU, in order. The
    # modules backend ran each MultiHeadedAttention (it holds the -1e9 masked_fill) whole in
    # fp32: 24 of the 32 Linears and all 12 matmuls the plan said ran in float16 ran in float32.
    # The fill is upcast at its own op now, and what still runs whole in fp32 is planned so.
    net, inputs = annotated_transformer.get_model(), annotated_transformer.example_inputs()
    model_mp = ampaudit.convert(net, inputs, backend=backend).eval()
    names = {"float16": torch.float16, "float32": torch.float32}
    planned = {kind: [names[r["compute"]] for r in model_mp.plan if r["kind"] == kind and r["op"].startswith("call_")]
               for kind in _TRANSFORMER_ATEN}
    assert not {r["kind"] for r in model_mp.plan if r["op"].startswith("call_")
                and r["compute"] in names} - set(_TRANSFORMER_ATEN)  # every computing op is checked
    with torch.no_grad(), _AtenDtypes() as seen:
        model_mp(*inputs)
    for kind, aten in _TRANSFORMER_ATEN.items():
        observed = [dtype for name, dtype in seen.ops if name == aten]
        assert planned[kind] and observed == planned[kind], (kind, observed)
    assert planned["linear"] == [torch.float16] * 32 and planned["masked_fill"] == [torch.float32] * 6
