"""Mixture-of-experts layers as transformers 5.x writes them (Mixtral, Qwen2-MoE, OLMoE):
the experts' matmul is ``F.grouped_mm``, which no autocast lowers. It was not in the catalog,
so convert planned it to follow its inputs and the experts - most of such a model's weights and
FLOPs - computed in fp32 (``hf:mixtral``: 22.2 KiB of float16 weights, 399.1 KiB of float32)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ampaudit
from ampaudit.core.config import Config
from fixtures.models import moe_grouped_experts as moe


class _GroupedMm(TorchDispatchMode):
    """The dtypes of each ``_grouped_mm`` call's two matrices."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_grouped_mm":
            self.calls.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def _relative_error(reference: torch.Tensor, value: torch.Tensor) -> float:
    return float((value.float() - reference).norm() / reference.norm())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grouped_mm_runs_in_the_low_dtype_the_plan_says(dtype):
    net, inputs = moe.get_model(), moe.example_inputs()
    model_mp = ampaudit.convert(net, inputs, dtype=dtype)
    assert model_mp.summary.backend == "modules"
    name = str(dtype).removeprefix("torch.")
    planned = [(r["compute"], r["rule"]) for r in model_mp.plan if r["kind"] == "grouped_mm"]
    assert planned == [(name, None)] * 2
    with torch.no_grad(), _GroupedMm() as seen:
        out = model_mp(*inputs)
    assert seen.calls == [(dtype, dtype)] * 2  # before: [(float32, float32)] * 2
    with torch.no_grad():
        reference = net(*inputs)
    assert _relative_error(reference, out) < (1e-2 if dtype == torch.float16 else 5e-2)


def test_the_experts_train_with_fp32_gradients_close_to_fp32s():
    net, inputs = moe.get_model(), moe.example_inputs()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model_mp, opt_mp = ampaudit.convert(net, opt, example_inputs=inputs, train_steps=0)
    reference = moe.get_model()
    reference(*inputs).square().mean().backward()
    opt_mp.backward(model_mp(*inputs).square().mean())
    opt_mp.unscale_()
    params = dict(model_mp.named_parameters())
    for name in ("experts.up", "experts.down"):
        grad = params[name].grad
        assert params[name].dtype == torch.float32 and grad.dtype == torch.float32
        assert _relative_error(dict(reference.named_parameters())[name].grad, grad) < 1e-2


def _fp16_grouped_mm_refused(dim: int, hidden: int) -> bool:
    x = torch.zeros(moe.TOKENS, dim, dtype=torch.float16)
    w = torch.zeros(moe.EXPERTS, 2 * hidden, dim, dtype=torch.float16).transpose(-2, -1)
    try:
        torch._grouped_mm(x, w, offs=torch.full((moe.EXPERTS,), moe.TOKENS, dtype=torch.int32))
    except RuntimeError:
        return True
    return False


def test_a_width_the_low_kernel_refuses_keeps_grouped_mm_in_fp32():
    # CPU's fp16 grouped_mm wants rows of whole 16 bytes; 36 fp16 values are 72: the cast-down
    # call raised, and convert exited 2 ("unexpected RuntimeError: strides should be multiple of
    # 16 bytes") where the model converts in fp32
    if not _fp16_grouped_mm_refused(36, 72):
        pytest.skip("this device's fp16 grouped_mm takes rows of 72 bytes")
    net, inputs = moe.odd_model(), moe.odd_inputs()
    model_mp = ampaudit.convert(net, inputs)
    planned = [r for r in model_mp.plan if r["kind"] == "grouped_mm"]
    assert [(r["compute"], r["rule"]) for r in planned] == [("float32", "kernel"), ("float32", None)]
    assert planned[0]["reason"].startswith("no float16 kernel for this op on cpu (RuntimeError: strides should be")
    # the kernel override runs the experts module whole in fp32, its second grouped_mm too
    assert planned[1]["reason"] == "runs in fp32: module experts runs whole in fp32"
    with torch.no_grad(), _GroupedMm() as seen:
        out = model_mp(*inputs)
    assert seen.calls == [(torch.float32, torch.float32)] * 2
    with torch.no_grad():
        reference = net(*inputs)
    assert _relative_error(reference, out) < 1e-2


def test_check_classifies_grouped_mm_as_low_precision_work():
    report = ampaudit.check(moe.get_model(), moe.example_inputs(), config=Config(fail_on="never"))
    grouped = [n for n in report.nodes if n.kind == "grouped_mm"]
    assert [n.precision.value for n in grouped] == ["fp16", "fp16"]
    # before: "`torch._grouped_mm` is not in the op catalog, so it is treated as neutral", twice
    assert [f.node for f in report.findings if f.rule == "AMP102"] == ["histc"]
