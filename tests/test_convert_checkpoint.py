"""convert keeps activation checkpointing (fixtures/models/checkpointed_gpt.py): each
``torch.utils.checkpoint`` call - reentrant or not, on a block, a closure, or through
``checkpoint_sequential`` - is still a checkpointed call in the converted model, with the ops
inside converted. Checked by training against the original under autocast: the same gradients,
parameter by parameter, and no more activation memory."""

from __future__ import annotations

import copy
import pickle
import sys

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import ampaudit  # noqa: E402
from ampaudit.load.loader import load_target  # noqa: E402
from tests.conftest import ROOT, model  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from convert_speed import peak_rise, train_step  # noqa: E402

VARIANTS = ["get_model", "reentrant_model", "closure_model", "sequential_model"]


def _gpt(variant: str):
    loaded = load_target(f"{model('checkpointed_gpt.py')}:{variant}")
    return loaded.model.train(), loaded.inputs.args[0]


def _loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), idx.roll(-1, 1).flatten())


@pytest.mark.parametrize("backend", ["fx", "modules"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpointed_blocks_train_as_under_autocast(variant, backend):
    net, idx = _gpt(variant)
    reference = copy.deepcopy(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    model_mp, opt_mp = ampaudit.convert(net, optimizer, example_inputs=(idx,), backend=backend, train_steps=0,
                                        loss_scale=None, weights="fp32")
    if backend == "fx":  # every call is still a checkpoint call, with its ops converted inside
        parts = [value for name, value in vars(model_mp).items() if name.startswith("ampaudit_checkpoint_")]
        sequential = variant == "sequential_model"  # checkpoint_sequential runs its last segment as it is
        assert len(parts) == (1 if sequential else 2)
        assert all(part.kwargs["use_reentrant"] is (variant == "reentrant_model") for part in parts)
        assert all("torch.float16" in part.code and "c_fc" in part.code for part in parts)
        assert ("c_fc" in model_mp.code) is sequential
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        opt_mp.zero_grad()
        ref_optimizer.zero_grad()
        opt_mp.backward(_loss(model_mp(idx), idx))
        with torch.autocast("cpu", dtype=torch.float16):
            logits = reference(idx)
        _loss(logits, idx).backward()
        for (name, mine), (_, theirs) in zip(model_mp.named_parameters(), reference.named_parameters(), strict=True):
            error = float((mine.grad - theirs.grad).norm() / theirs.grad.norm())
            assert error < 0.02, (step, name, error)
        opt_mp.step()
        ref_optimizer.step()


# checkpoint_sequential runs its last segment (the second block) as it is: there the plan's
# softmax and layer norms compute in fp32, as CUDA autocast runs them, where CPU autocast, the
# reference here, runs them in fp16 - 32 KB more (1.12x), not activations checkpointing lost
_CPU_POLICY = pytest.mark.xfail(strict=True, reason="CPU autocast runs the uncheckpointed block's softmax in fp16")


@pytest.mark.parametrize("backend", ["fx", "modules"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_activation_memory_is_autocasts(variant, backend, request):
    if backend == "modules" and variant == "sequential_model":
        request.applymarker(_CPU_POLICY)
    net, idx = _gpt(variant)
    reference = copy.deepcopy(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    model_mp, opt_mp = ampaudit.convert(net, optimizer, example_inputs=(idx,), backend=backend, train_steps=0,
                                        loss_scale=None, weights="fp32")
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    converted = peak_rise(lambda: train_step("convert", lambda: _loss(model_mp(idx), idx), opt_mp, None, "cpu"))
    autocast = peak_rise(lambda: train_step("autocast", lambda: _loss(reference(idx), idx), ref_optimizer, scaler,
                                            "cpu"))
    # What the forward leaves for backward (the activations): traced through, the checkpoints were
    # gone and every block's activations kept - 349 KB against autocast's 135 KB. Kept, 105 KB: the
    # parts recompute their weights' casts in backward, where autocast's cache holds them.
    # The modules backend runs the user's own forward, checkpoint calls and all.
    assert converted["forward"] <= 1.1 * autocast["forward"], (converted, autocast)


def test_cli_export_shows_each_checkpointed_part_and_apply_keeps_them(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("convert", f"{model('checkpointed_gpt.py')}:reentrant_model", "-o", out, "--train-steps", "2")
    assert result.code == 0, result.err
    assert "2 torch.utils.checkpoint call(s) kept" in " ".join(result.out.split())
    module = (out / "module.py").read_text()
    assert "def ampaudit_checkpoint_1(self, " in module and "use_reentrant=True" in module
    net, idx = _gpt("reentrant_model")
    applied = ampaudit.apply(net, out)
    copied = copy.deepcopy(applied)  # the training check's copy: each part runs the copy's own weights
    assert copied.ampaudit_checkpoint_0.owner is copied and applied.ampaudit_checkpoint_0.owner is applied
    assert list(applied.state_dict()) == list(net.state_dict())
    with torch.no_grad():
        assert torch.equal(copied(idx), applied(idx))


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_converted_graph_with_checkpointed_parts_pickles_and_loads_bit_for_bit(variant, tmp_path):
    """``torch.save(model)`` of an fx-converted model with checkpointed parts: each part held the
    function fx compiled from its code, which pickle cannot name (PicklingError), and the load's
    trace of the outer code took the part for a constant (NotImplementedError) and a buffer for a
    plain tensor (the block checkpoint_sequential leaves out: ``attn.bias[:, :, :T, :T]``, T a
    traced size - TypeError). Loaded, each part
    runs the loaded model's own weights, forward and backward as the converted model did."""
    net, idx = _gpt(variant)
    converted = ampaudit.convert(net, (idx,), backend="fx", train_steps=0)
    torch.save(converted, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    names = sorted(name for name in vars(converted) if name.startswith("ampaudit_checkpoint_"))
    assert len(names) == (1 if variant == "sequential_model" else 2)
    assert all(getattr(loaded, name).owner is loaded for name in names)
    assert all(getattr(loaded, name).kwargs == getattr(converted, name).kwargs for name in names)
    assert all(getattr(loaded, name).code == getattr(converted, name).code for name in names)
    outputs = []
    for model_ in (converted, loaded):
        model_.zero_grad()
        out = model_(idx)
        _loss(out, idx).backward()
        outputs.append((out, [p.grad for p in model_.parameters()]))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outputs[0][1], outputs[1][1], strict=True))
    again = pickle.loads(pickle.dumps(loaded))  # a loaded model pickles again, as does its deep copy
    twin = copy.deepcopy(again)
    assert all(getattr(twin, name).owner is twin for name in names)
    with torch.no_grad():
        assert torch.equal(twin(idx), converted(idx))
