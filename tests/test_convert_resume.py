"""From an export back to training: ``ampaudit.convert(applied, optimizer)`` on a model that
``ampaudit.apply`` loaded does not convert it again - it adds loss scaling and fp32 masters -
and training continues as if it had never stopped."""

from __future__ import annotations

import copy

import pytest
import torch

import ampaudit
from ampaudit.convert.export import export
from ampaudit.load.loader import load_target
from tests.conftest import model

STEPS = 4


def _train(model_mp, opt_mp, inputs, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = model_mp(*inputs.args, **inputs.kwargs)
        opt_mp.zero_grad()
        opt_mp.backward(loss)
        opt_mp.step()
        losses.append(float(loss.detach()))
    return losses


def _fresh():
    torch.manual_seed(0)
    return load_target(model("tied_gpt.py"))


@pytest.mark.parametrize("backend", ["fx", "modules"])
@pytest.mark.parametrize("weights", ["low", "fp32"])
def test_training_resumes_from_an_export(tmp_path, backend, weights):
    loaded = _fresh()
    optimizer = torch.optim.AdamW(loaded.model.parameters(), lr=1e-3)
    model_mp, opt_mp = ampaudit.convert(loaded.model, optimizer, example_inputs=loaded.inputs, backend=backend,
                                        weights=weights, train_steps=0)
    first = _train(model_mp, opt_mp, loaded.inputs, STEPS)
    export(model_mp, tmp_path / "out", summary=model_mp.summary.to_dict())
    # the optimizer's state, the loss scale and the fp32 masters, as torch.save keeps them (a
    # state_dict holds the optimizer's live tensors, which the next steps update in place)
    saved = copy.deepcopy(opt_mp.state_dict())
    uninterrupted = _train(model_mp, opt_mp, loaded.inputs, STEPS)

    applied = ampaudit.apply(_fresh().model, tmp_path / "out")
    resumed_mp, resumed_opt = ampaudit.convert(applied, torch.optim.AdamW(applied.parameters(), lr=1e-3),
                                               example_inputs=loaded.inputs)
    assert resumed_mp is applied  # converted once: not again
    assert applied.lm_head.weight is applied.wte.weight
    resumed_opt.load_state_dict(saved)
    resumed = _train(resumed_mp, resumed_opt, loaded.inputs, STEPS)
    assert resumed == uninterrupted  # bit for bit
    assert first[0] - uninterrupted[-1] > 0.3  # it trained

    # without the optimizer's state (a fresh AdamW, masters from the exported weights), the
    # run continues within the training check's tolerance
    applied = ampaudit.apply(_fresh().model, tmp_path / "out")
    _, fresh_opt = ampaudit.convert(applied, torch.optim.AdamW(applied.parameters(), lr=1e-3))
    again = _train(applied, fresh_opt, loaded.inputs, STEPS)
    assert again[0] == pytest.approx(uninterrupted[0], rel=1e-3)
    assert again[-1] == pytest.approx(uninterrupted[-1], rel=2e-2)


def test_convert_returns_a_converted_model_as_it_is(tmp_path):
    loaded = _fresh()
    model_mp = ampaudit.convert(loaded.model, loaded.inputs)
    assert ampaudit.convert(model_mp, loaded.inputs) is model_mp
