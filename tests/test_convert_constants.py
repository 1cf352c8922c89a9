"""Constants out of the low dtype's range never crash a converted model (the most common
attention pattern: scores from an fp16 matmul filled with -1e9), whichever way they are
written and whether the attention is traced with its model or on its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampaudit

NEG = -1e9


class _Attention(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)
        self.neg = -1e9
        self.register_buffer("neg_buffer", torch.tensor(-1e9))

    def forward(self, x, mask):
        s = self.q(x) @ self.k(x).transpose(-1, -2)  # fp16 scores after conversion
        fill = {"literal": -1e9, "finfo": torch.finfo(torch.float32).min, "attribute": self.neg, "global": NEG,
                "buffer": self.neg_buffer}
        if self.variant in fill:
            s = s.masked_fill(~mask, fill[self.variant])
        elif self.variant == "in-place":
            s.masked_fill_(~mask, -1e9)
        elif self.variant == "where":
            s = torch.where(mask, s, torch.tensor(-1e9))
        elif self.variant == "where-scalar":
            s = torch.where(mask, s, -1e9)
        elif self.variant == "additive":
            s = s + (~mask).float() * -1e9
        elif self.variant == "full":
            s = torch.where(mask, s, torch.full_like(s, torch.finfo(torch.float32).min))
        return s.softmax(-1)


class _Untraceable(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.attn = _Attention(variant)

    def forward(self, x, mask):
        if x.sum() > -1e30:  # data-dependent Python: fx cannot trace it, so attn is converted on its own
            return self.attn(x, mask)
        return x


VARIANTS = ["literal", "finfo", "attribute", "global", "buffer", "in-place", "where", "where-scalar", "additive",
            "full"]


@pytest.mark.parametrize("constants", ["fp32", "clamp"])
@pytest.mark.parametrize("wrapper", [_Attention, _Untraceable])
def test_out_of_range_constants_never_crash(wrapper, constants):
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    mask = torch.tril(torch.ones(8, 8, dtype=torch.bool))
    for variant in VARIANTS:
        torch.manual_seed(0)
        model = wrapper(variant)
        model_mp = ampaudit.convert(model, (x, mask), constants=constants)
        with torch.no_grad():
            reference, out = model(x, mask), model_mp(x, mask)
        assert torch.isfinite(out).all(), variant
        assert float((out.float() - reference).norm() / reference.norm()) < 1e-2, variant
        scores = [r for r in model_mp.plan if r["kind"] == "matmul"]
        if wrapper is _Untraceable and variant == "in-place":
            # the modules backend cannot upcast an in-place fill at its op: attn runs whole in
            # fp32, and the plan says so (it said float16 for this matmul, which ran in fp32)
            assert scores and scores[0]["compute"] == "float32" and "runs whole in fp32" in scores[0]["reason"]
            continue
        assert scores and scores[0]["compute"] == "float16", variant  # the matmul itself stays fast
