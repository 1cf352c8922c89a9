"""Modules whose class pickles only its configuration and runs ``__init__`` again on load
(einops' ``Reduce`` and ``Rearrange``, in lucidrains' MaxViT): what convert sets on such a
module must survive a copy and a pickle of the converted model. Before, the training check's
copy lost ``ampaudit_fp32_ops`` on the ``Reduce`` leaves and ``ampaudit convert`` exited 2
("unexpected AttributeError: 'Reduce' object has no attribute 'ampaudit_fp32_ops'")."""

import copy
import io

import torch

import ampaudit
from ampaudit.convert.fp32_ops import Fp32Ops
from fixtures.models import einops_style_layers as einops_style


def _converted():
    net, inputs = einops_style.get_model(), einops_style.example_inputs()
    model_mp = ampaudit.convert(net, inputs)
    assert model_mp.summary.backend == "modules"
    # each Reduce's mean is an fp32 op upcast at its own site
    means = [(r["module"], r["compute"]) for r in model_mp.plan if r["kind"] == "mean"]
    assert means == [("se.gate.0", "float32"), ("pool", "float32")]
    return net, inputs, model_mp


def test_a_copy_and_a_pickle_of_the_converted_model_run_as_it_does():
    _, inputs, model_mp = _converted()
    with torch.no_grad():
        expected = model_mp(*inputs)
    buffer = io.BytesIO()
    torch.save(model_mp, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(model_mp), torch.load(buffer, weights_only=False)):
        assert isinstance(twin.se.gate[0].ampaudit_fp32_ops, Fp32Ops)
        with torch.no_grad():
            assert torch.equal(twin(*inputs), expected)


def test_the_training_check_passes():
    net, inputs = einops_style.get_model(), einops_style.example_inputs()
    model_mp, _ = ampaudit.convert(net, torch.optim.AdamW(net.parameters(), lr=1e-3), example_inputs=inputs)
    train = model_mp.summary.train
    assert train["steps"] == 20 and len(train["converted"]) == 20 and train["worst"] <= train["tolerance"]
