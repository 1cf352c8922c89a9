"""convert on timm models (code ampaudit did not write), built with pretrained=False: nothing
is downloaded. Skipped where timm is not installed (it needs a torchvision built for the
installed torch)."""

from __future__ import annotations

import pytest
import torch

import ampaudit

timm = pytest.importorskip("timm", reason="timm is an optional extra")


@pytest.mark.parametrize("weights", ["auto", "low"])
@pytest.mark.parametrize("backend", ["auto", "modules"])
def test_timm_efficientnet_b0_converts_verifies_and_trains(backend, weights):
    torch.manual_seed(0)
    model = timm.create_model("efficientnet_b0", pretrained=False).eval()
    x = (torch.randn(2, 3, 64, 64),)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model_mp, _ = ampaudit.convert(model, optimizer, example_inputs=x, backend=backend, train_steps=3,
                                   weights=weights)
    summary = model_mp.summary
    assert summary.backend == ("fx" if backend == "auto" else "modules")  # timm's forward traces
    assert summary.error_after < 1e-2 and summary.search["forwards"] <= 20
    assert summary.train["passed"] and summary.train["skipped"] == 0
    if weights == "low":  # stored low: most of the weights in float16
        assert summary.param_bytes["float16"] > summary.param_bytes.get("float32", 0)
    else:  # the training default: every weight fp32, cast at each use
        assert set(summary.param_bytes) == {"float32"} and summary.weights == "fp32"
