"""The loss a model computes itself (core/tensors.own_loss): where a training check, the fp8
audit's recording backward and the emitted fp8 file's verification take their loss from. They
took the first float tensor, so karpathy's GPT, which returns ``(logits, loss)``, trained its
logits to a made-up target and the fp8 audit measured gradients of a mean square it never sees."""

from __future__ import annotations

import json
import math
import re
import types

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampaudit.core.tensors import given_labels, own_loss
from ampaudit.graph.fp8_measure import model_loss


def test_own_loss_is_the_loss_the_model_returns_in_any_of_its_shapes():
    logits, loss = torch.randn(4, 8, requires_grad=True), torch.tensor(2.5, requires_grad=True)
    assert own_loss((logits, loss), labelled=True) is loss  # karpathy's GPT, given targets
    assert own_loss([loss, logits, torch.randn(3)], labelled=True) is loss  # transformers without return_dict
    assert own_loss(types.SimpleNamespace(loss=loss, logits=logits)) is loss  # a ModelOutput
    assert own_loss(loss) is loss
    assert own_loss((logits, loss)) is None  # no targets passed: a lone scalar may be a router's aux loss
    assert own_loss((logits, None), labelled=True) is None
    assert own_loss(logits) is None and own_loss({"loss": None, "logits": logits}) is None
    assert own_loss((logits, loss, torch.tensor(0.1)), labelled=True) is None  # which is the loss is not said
    assert own_loss((logits, torch.tensor(3)), labelled=True) is None  # an int count is no loss


def test_targets_are_known_by_the_forwards_own_names():
    def gpt(idx, targets=None): ...
    def moe(x): ...
    def hf(input_ids=None, labels=None, **kwargs): ...
    idx = torch.zeros(2, 4, dtype=torch.long)
    assert given_labels(gpt, (idx, idx), {}) and not given_labels(gpt, (idx,), {})
    assert not given_labels(gpt, (idx, None), {}) and not given_labels(moe, (idx,), {})
    assert given_labels(hf, (), {"input_ids": idx, "labels": idx}) and not given_labels(hf, (), {"input_ids": idx})
    assert not given_labels(lambda *a, **k: None, (idx, idx), {})  # a signature that cannot say


class _LogitsAndLoss(nn.Module):
    """karpathy/nanoGPT's contract: ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)

    def forward(self, idx, targets=None):
        logits = self.head(self.emb(idx))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def test_the_fp8_audit_backpropagates_the_models_own_loss():
    torch.manual_seed(0)
    model = _LogitsAndLoss()
    idx = torch.randint(0, 64, (2, 16))
    logits, loss = model(idx, idx)
    assert torch.equal(model_loss((logits, loss), labelled=True), loss.float())
    assert torch.equal(model_loss((logits, loss)), logits.float().square().mean() + loss.float().square().mean())


def test_convert_trains_a_logits_and_loss_model_on_its_own_cross_entropy(cli, tmp_path):
    pytest.importorskip("torchao.float8")
    source = tmp_path / "lm.py"
    source.write_text(
        "import torch\nfrom torch import nn\nfrom torch.nn import functional as F\n\n\n"
        "class LM(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)\n\n"
        "    def forward(self, idx, targets):\n        logits = self.head(self.emb(idx))\n"
        "        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())\n\n\n"
        "def example_inputs():\n    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))\n"
        "    return (idx, idx)\n")
    out = tmp_path / "out"
    result = cli("convert", source, "--dtype", "fp8", "--emit", "torchao", "--train-steps", "3", "-o", out)
    assert result.code == 0, result.err
    train = json.loads((out / "fp8_plan.json").read_text())["train"]
    # cross-entropy of 64 classes at init is about ln 64 = 4.16; the MSE to a random target was ~0.1
    assert abs(train["bf16"][0] - math.log(64)) < 0.5 and abs(train["fp8"][0] - math.log(64)) < 0.5
    result = cli("convert", source, "--dtype", "bfloat16", "-o", tmp_path / "bf16")
    assert result.code == 0, result.err
    # the fp16/bf16 training check, too, on its own loss (the MSE to a random target ended near 0.02)
    words = " ".join(w for w in result.out.split() if w != "│")
    end = re.search(r"training check \d+ steps: loss ([0-9.]+) vs ([0-9.]+) in fp32", words)
    assert end and 2.5 < float(end.group(1)) < 4.2 and 2.5 < float(end.group(2)) < 4.2, words


def test_a_model_returning_an_auxiliary_scalar_without_targets_is_trained_to_a_target_not_on_it(cli, tmp_path):
    # (output, aux_loss) - a mixture of experts' router loss - is no training loss: without targets
    # passed, the check trains the output to a fixed target as before
    source = tmp_path / "moe.py"
    source.write_text(
        "import torch\nfrom torch import nn\n\n\nclass MoE(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.router, self.expert = nn.Linear(32, 2), nn.Linear(32, 32)\n\n"
        "    def forward(self, x):\n        aux = self.router(x).softmax(-1).square().mean()\n"
        "        return self.expert(x), aux\n\n\n"
        "def example_inputs():\n    return (torch.randn(16, 32, generator=torch.Generator().manual_seed(0)),)\n")
    result = cli("convert", source, "--dtype", "bfloat16", "-o", tmp_path / "bf16")
    assert result.code == 0, result.err
    words = " ".join(w for w in result.out.split() if w != "│")
    end = re.search(r"training check \d+ steps: loss ([0-9.e-]+) vs ([0-9.e-]+) in fp32", words)
    # the MSE to a random target ends at 0.48; the router's loss, trained, would end near its floor 0.25
    assert end and float(end.group(1)) > 0.4, words
