"""check --dtype fp8 emulates torchao's casts on the CPU; on a GPU with fp8 tensor cores (compute
capability 8.9+: Ada, Hopper, Blackwell) torchao runs them as CUDA kernels and its GEMMs in
torch._scaled_mm (issue 29: "the emulated casts match torchao's real kernels on the same inputs").

- Each cast - scale and fp8 bits - of each torchao recipe, taken on the GPU by torchao's own
  cast (``hp_tensor_to_float8_dynamic``), equals ampaudit's emulated cast of the same tensor on
  the CPU bit for bit: the scale from the amax, the rounding to e4m3/e5m2, are the same
  arithmetic.
- A ``Float8Linear`` with the real kernels (``emulate=False``) against ampaudit's emulated GEMMs
  (``linear_gemms``): output, input gradient and weight gradient. ``_scaled_mm`` accumulates in
  its own order, so these agree to rounding: at least ``MIN_AGREEMENT_DB`` of SQNR between the
  two, far above the fp8 error itself (~25-30 dB against fp32), printed for docs/benchmarks.md.

Skipped without CUDA or on older GPUs; run with ``python -m pytest -s tests/test_fp8_cuda.py``
where a GPU is lent.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from ampaudit.graph.fp8_casts import RECIPES, TORCHAO_RECIPES, cast, linear_gemms
from ampaudit.graph.fp8_measure import sqnr_db

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                       reason="torch._scaled_mm needs compute capability 8.9+"),
]
MIN_AGREEMENT_DB = 60.0  # real vs emulated GEMMs: accumulation order only (fp8's own error: ~25-30 dB)


def _inputs(m: int = 256, k: int = 512, n: int = 384) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(k, n)
    x = torch.randn(m, k, generator=g)
    x[3] *= 3000.0  # a massive token: row and tensor scales differ
    grad = torch.randn(m, n, generator=g) * 1e-3
    return linear, x, grad


@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
def test_torchaos_cuda_casts_equal_the_emulated_casts_bit_for_bit(recipe):
    pytest.importorskip("torchao.float8")
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    linear, x, grad = _inputs()
    w = linear.weight.detach()
    # (operand, torchao's cast config, ampaudit's cast, the reduction dim the scale runs along)
    cases = [(x, config.cast_config_input, RECIPES[recipe].input, -1),
             (w.t().contiguous(), config.cast_config_weight, RECIPES[recipe].weight, 0),
             (grad, config.cast_config_grad_output, RECIPES[recipe].grad_output, -1),
             (x, config.cast_config_input_for_grad_weight, RECIPES[recipe].input_for_grad_weight, 0)]
    compared = 0
    for tensor, theirs, mine, dim in cases:
        if theirs.scaling_type is ScalingType.DISABLED:
            assert mine.fmt is None
            continue
        axiswise = theirs.scaling_granularity is ScalingGranularity.AXISWISE
        t = hp_tensor_to_float8_dynamic(tensor.cuda(), theirs.target_dtype, LinearMMConfig(),
                                        scaling_granularity=theirs.scaling_granularity,
                                        axiswise_dim=dim if axiswise else None,
                                        round_scales_to_power_of_2=config.round_scales_to_power_of_2)
        theirs_value = t._data.float().cpu() / t._scale.cpu()
        ours = cast(tensor, mine, dim, pow2=RECIPES[recipe].pow2_scales).value
        assert torch.equal(ours, theirs_value), (recipe, mine)
        compared += 1
    assert compared >= 3


@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
def test_real_fp8_gemms_agree_with_the_emulated_ones(recipe):
    pytest.importorskip("torchao.float8")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    linear, x, grad = _inputs()
    real = nn.Sequential(copy.deepcopy(linear)).cuda()
    convert_to_float8_training(real, config=dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe),
                                                                emulate=False))
    xr = x.clone().cuda().requires_grad_()
    out = real(xr)
    out.backward(grad.cuda())
    mine = linear_gemms(x, linear.weight.detach(), grad, RECIPES[recipe])
    fp32 = linear(x)
    agreement = {
        "output": sqnr_db(mine.output + linear.bias.detach(), out.detach().float().cpu()),
        "grad_input": sqnr_db(mine.grad_input, xr.grad.float().cpu()),
        "grad_weight": sqnr_db(mine.grad_weight, real[0].weight.grad.float().cpu()),
    }
    fp8_error = sqnr_db(fp32.detach(), mine.output + linear.bias.detach())
    print(f"\n{recipe} on {torch.cuda.get_device_name()}: real vs emulated SQNR (dB) "
          + ", ".join(f"{k} {v:.1f}" for k, v in agreement.items()) + f"; emulated fp8 vs fp32 output {fp8_error:.1f}")
    assert min(agreement.values()) >= MIN_AGREEMENT_DB, agreement
    assert fp8_error < MIN_AGREEMENT_DB  # the agreement is far finer than what fp8 itself loses
