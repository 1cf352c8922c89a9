"""Attention scores filled with a constant fp16 cannot hold, after arithmetic with Python numbers:
the Annotated Transformer's ``matmul(q, k.T) / math.sqrt(d_k)`` then ``masked_fill(mask == 0, -1e9)``
(fixtures/models/annotated_transformer.py), and einsum scores filled with
``torch.finfo(torch.float32).min``. A Python number does not promote the scores to fp32: the
fill must get its cast to fp32, or it raises "value cannot be converted to type c10::Half"."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import ampaudit  # noqa: E402
from ampaudit.load.loader import load_target  # noqa: E402
from tests.conftest import model  # noqa: E402

FIXTURE = model("annotated_transformer.py")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("backend", ["fx", "auto"])
def test_annotated_transformer_converts_and_matches_fp32(backend):
    loaded = load_target(FIXTURE)
    net, inputs = loaded.model.eval(), loaded.inputs.args
    model_mp = ampaudit.convert(net, inputs, backend=backend)
    assert model_mp.summary.backend == "fx"  # the whole model traces: auto picks the graph rewrite
    fills = [r for r in model_mp.plan if r["kind"] == "masked_fill"]
    assert len(fills) == 6 and all(r["compute"] == "float32" and r["rule"] == "AMP201" for r in fills)
    with torch.no_grad():
        out, ref = model_mp(*inputs), net(*inputs)
    assert out.dtype == torch.float32 and _rel(out, ref) < 1e-2
    # the scores' division by math.sqrt(d_k) stays fp16 and follows its input: no fp32 claimed for it
    divisions = [r for r in model_mp.plan if r["kind"] == "div" and r["module"].endswith("attn")]
    assert divisions and {r["dtype"] for r in divisions} == {"float16"}


def test_cli_converts_the_annotated_transformer(cli, tmp_path):
    result = cli("convert", FIXTURE, "-o", tmp_path / "out", "--train-steps", "0")
    assert result.code == 0, result.err
    assert "error vs fp32" in result.out
    loaded = load_target(FIXTURE)
    model_mp = ampaudit.apply(loaded.model, tmp_path / "out")
    with torch.no_grad():
        assert _rel(model_mp(*loaded.inputs.args), loaded.model.eval()(*loaded.inputs.args)) < 1e-2


class EinsumAttention(nn.Module):
    """Scores from einsum scaled by a size read off a tensor, padding filled with fp32's lowest value."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~mask[:, None, None, :], torch.finfo(torch.float32).min)
        return self.out(torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, n, d))


def test_einsum_scores_filled_with_float32_min():
    torch.manual_seed(0)
    net = EinsumAttention().eval()
    x, mask = torch.randn(2, 6, 32), torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    model_mp = ampaudit.convert(net, (x, mask), backend="fx")
    (fill,) = [r for r in model_mp.plan if r["kind"] == "masked_fill"]
    assert (fill["compute"], fill["rule"]) == ("float32", "AMP201")
    with torch.no_grad():
        assert _rel(model_mp(x, mask), net(x, mask)) < 1e-2
