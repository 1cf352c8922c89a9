"""Patterns of real model code that must raise no false alarm: in-place activations,
checks and size arithmetic, identity-like modules, untrained BatchNorms, precision a model
declares for itself - and the timm / torchvision models they come from."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from torch import fx, nn

import ampaudit
from ampaudit.check.api import check_path
from ampaudit.core.catalog import builtin_catalog
from ampaudit.core.config import Config
from ampaudit.core.dtypes import LowDtype
from ampaudit.graph.declared import declared_precision
from ampaudit.graph.kinds import node_kind
from ampaudit.graph.python_values import python_values
from ampaudit.graph.range_probe import MEASURED, probe, untrained_batch_norm, writes_in_place
from tests.conftest import line_of, model

NEVER = Config(fail_on="never")


def _check(spec: str, **kwargs):
    return check_path(spec, config=NEVER, **kwargs)


def _codes(report):
    return [(f.rule, f.line) for f in report.findings]


def _probe(module, *args, dtype=torch.float16):
    gm = fx.symbolic_trace(module)
    catalog = builtin_catalog()
    kinds = {n: node_kind(n, gm, catalog)[0] for n in gm.graph.nodes}
    out = probe(gm, dtype, kinds, args, {})
    return {n.name: n.meta.get(MEASURED) for n in gm.graph.nodes}, out


# -- in-place ops --------------------------------------------------------------------------


class _ConvBnAct(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = act

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


def _trained(module):
    """Running statistics as after training, so BatchNorm runs as in eval mode."""
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 2.0)
            m.num_batches_tracked.fill_(100)
    return module.eval()


@pytest.mark.parametrize("act", [nn.SiLU, nn.ReLU, nn.Hardswish])
def test_in_place_activation_is_measured_on_the_values_it_overwrites(act):
    torch.manual_seed(0)
    inplace = _trained(_ConvBnAct(act(inplace=True)))
    plain = _trained(_ConvBnAct(act()))
    plain.load_state_dict(inplace.state_dict())
    x = torch.randn(2, 3, 8, 8)
    measured_inplace, out_inplace = _probe(inplace, x)
    measured_plain, out_plain = _probe(plain, x)
    assert measured_inplace == measured_plain  # every statistic, the input's and the op's error too
    with torch.no_grad():
        torch.testing.assert_close(out_inplace, plain(x), rtol=0, atol=0)  # the fp32 run is the model's
        torch.testing.assert_close(out_plain, out_inplace, rtol=0, atol=0)
        # The activation's error against fp32, computed by hand: its input rounded, its output rounded.
        h = plain.bn(plain.conv(x))
        ref = plain.act(h)
        low = plain.act(h.half().float()).half().float()
    expected = float((low - ref).norm() / ref.norm())
    assert measured_inplace["act"].rel_error == pytest.approx(expected, rel=1e-6)
    assert measured_inplace["act"].bits_lost == 0


class _InPlaceOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.gamma = nn.Parameter(torch.full((16,), 0.1))

    def forward(self, x):
        h = self.fc(x)
        a = torch.nn.functional.relu(h, inplace=True)
        b = self.fc(x).mul_(self.gamma)  # timm's LayerScale(inplace=True)
        c = torch.tanh_(self.fc(x))
        return a + b + c


def test_in_place_functions_and_methods():
    torch.manual_seed(0)
    measured, _ = _probe(_InPlaceOps().eval(), torch.randn(4, 16))
    for name in ("relu", "mul_", "tanh_"):
        assert measured[name].bits_lost == 0 and measured[name].rel_error < 2e-3, name


def test_what_writes_in_place():
    gm = fx.symbolic_trace(_InPlaceOps())
    nodes = {n.name: n for n in gm.graph.nodes}
    assert [n for n in nodes if writes_in_place(nodes[n], gm)] == ["relu", "mul_", "tanh_"]
    seq = fx.symbolic_trace(nn.Sequential(nn.SiLU(inplace=True), nn.SiLU()))
    assert [writes_in_place(n, seq) for n in seq.graph.nodes if n.op == "call_module"] == [True, False]


class _Doubler(nn.Module):
    def forward(self, x):
        return x.mul_(2)  # writes in place, but nothing in its name or attributes says so


class _Hidden(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.doubler = _Doubler()

    def forward(self, x):
        return self.doubler(torch.tanh(self.fc(x)))


def test_an_unannounced_in_place_write_is_not_compared():
    # The module is kept whole (a policy names it), so the probe cannot see the mul_ inside.
    report = ampaudit.check(_Hidden(), (torch.randn(4, 8),), policy={"modules": {"_Doubler": "mul"}}, config=NEVER)
    node = next(n for n in report.nodes if n.module == "doubler")
    assert node.measured["rel_error"] is None and node.measured["bits_lost"] is None
    assert not [f for f in report.findings if f.rule == "AMP303"]


def test_in_place_integer_ops_leave_the_values_alone():
    class Shift(nn.Module):  # T5's _shift_right: in-place writes on token ids
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, ids):
            shifted = ids.new_zeros(ids.shape)
            shifted[..., 1:] = ids[..., :-1].clone()
            shifted.masked_fill_(shifted == 9, 0)
            return self.emb(shifted.add_(1))

    ids = torch.tensor([[1, 2, 8, 5]])
    report = ampaudit.check(Shift(), (ids,), config=NEVER)
    assert report.summary()["errors"] == 0  # the probe ran: add_ ran once, ids stayed in range


# -- checks and size arithmetic -----------------------------------------------------------------


def test_size_arithmetic_has_no_precision():
    gm = fx.symbolic_trace(__import__("fixtures.models.timm_style", fromlist=["Attention"]).Attention(32))
    python = {n.name for n in python_values(gm)}
    assert {"getattr_1", "floordiv", "pow_1"} <= python
    assert not python & {"qkv", "mul", "matmul", "softmax", "proj"}


def test_timm_style_model_is_clean():
    path = model("timm_style.py")
    report = _check(path)
    assert report.target.trace == "fx" and report.findings == []
    by_line = {}
    for n in report.nodes:
        by_line.setdefault(n.line, []).append(n)
    (check,) = [n for n in report.nodes if n.kind == "_assert"]
    assert check.precision.value == "neutral" and check.reason.startswith("a check")
    head_dim = line_of(path, "head_dim = C // self.num_heads")
    floordivs = [n for n in by_line[head_dim] if n.op == "call_function"]
    assert len(floordivs) == 2  # one per block
    assert all(n.precision.value == "neutral" and n.reason.startswith("Python arithmetic") for n in floordivs)
    scale = line_of(path, "attn = (q * head_dim ** -0.5)")
    assert {n.precision.value for n in by_line[scale] if n.kind == "pow"} == {"neutral"}  # a pow of sizes
    assert not [n for n in report.nodes if n.precision.value == "fp32" and n.measured is None and n.op != "output"]


def test_linear_called_with_keyword_tensors_is_measured():
    # BEiT's qkv: F.linear(input=x, weight=self.qkv.weight, bias=qkv_bias); the range probe read
    # its first two positional arguments and raised "not enough values to unpack" (exit 2)
    path = model("keyword_linear.py")
    report = _check(path)
    assert report.target.trace == "fx" and report.findings == []
    (qkv,) = [n for n in report.nodes if n.kind == "linear" and n.line == line_of(path, "qkv = F.linear(")]
    assert qkv.precision.value == "fp16" and qkv.module == "block.attn"
    assert qkv.measured is not None and 0 < qkv.measured["rel_error"] < 1e-3  # fp16 rounding, measured

# -- identity-like modules ----------------------------------------------------------------------------


def test_identity_like_modules_do_not_repeat_findings():
    path = model("identity_like.py")
    report = _check(path)
    assert _codes(report) == [("AMP302", line_of(path, "tiny = self.fc(x)")),
                              ("AMP208", line_of(path, "logs = torch.log("))]


# -- BatchNorm that was never trained -------------------------------------------------------------


def test_torchvision_style_resnet_is_clean_traced_and_recorded():
    assert _check(model("torchvision_style.py")).findings == []
    recorded = _check(model("torchvision_style.py") + ":recorded_model")
    assert recorded.target.trace == "recorder"
    assert [f.rule for f in recorded.findings] == ["AMP001"]  # `out += identity` and `relu_` measured right


def test_untrained_batch_norm_normalises_with_batch_statistics():
    # 50 residual blocks built, not trained: eval-mode BatchNorm (mean 0, var 1) would let the
    # activations grow to 1e8 and report an overflow no training step sees.
    report = _check(model("torchvision_style.py") + ":deep_model")
    assert report.findings == []
    assert max(n.measured["absmax"] for n in report.nodes if n.measured) < 1000


def test_batch_norm_statistics_measured():
    torch.manual_seed(0)
    fresh = _ConvBnAct(nn.Identity()).eval()
    assert untrained_batch_norm(fresh.bn)
    x = torch.randn(4, 3, 8, 8) * 5 + 3
    measured, out = _probe(fresh, x)
    with torch.no_grad():
        h = fresh.conv(x)
        expected = (h - h.mean((0, 2, 3), keepdim=True)) / torch.sqrt(h.var((0, 2, 3), unbiased=False,
                                                                           keepdim=True) + fresh.bn.eps)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert measured["bn"].bits_lost == 0
    assert int(fresh.bn.num_batches_tracked) == 0 and not fresh.bn.running_mean.any()  # left alone
    trained = _trained(fresh)
    assert not untrained_batch_norm(trained.bn)
    _, out = _probe(trained, x)
    with torch.no_grad():
        torch.testing.assert_close(out, trained(x), rtol=0, atol=0)  # trained statistics: eval mode as is


# -- precision the model declares -------------------------------------------------------------------


class _FeedForward(nn.Module):
    def __init__(self, scale=1.0):
        super().__init__()
        self.wi = nn.Linear(8, 32, bias=False)
        self.wo = nn.Linear(32, 8, bias=False)
        with torch.no_grad():
            self.wo.weight.mul_(scale)

    def forward(self, x):
        return self.wo(torch.relu(self.wi(x)))


class _Declaring(nn.Module):
    """What transformers' PreTrainedModel carries: _keep_in_fp32_modules and a config."""

    _keep_in_fp32_modules = ["wo"]

    def __init__(self, scale=1.0, dtype=None):
        super().__init__()
        self.config = SimpleNamespace(dtype=dtype)
        self.blocks = nn.Sequential(_FeedForward(scale), _FeedForward(scale))
        self.router = nn.Module()
        self.router.gate = nn.Linear(8, 2, bias=False)

    def forward(self, x):
        return self.blocks(x) + self.router.gate(x).sum(-1, keepdim=True)


def test_declared_fp32_modules_are_matched_like_transformers():
    declared = declared_precision(_Declaring(), LowDtype.parse("float16"))
    assert [m.path for m in declared.fp32] == ["blocks.0.wo", "blocks.1.wo"]
    assert declared_precision(_Declaring(), LowDtype.parse("bfloat16")).fp32 == ()  # fp16 only

    strict = _Declaring()
    strict._keep_in_fp32_modules = None
    strict._keep_in_fp32_modules_strict = {"gate.weight"}  # a parameter name keeps its module
    for dtype in ("float16", "bfloat16"):
        assert [m.path for m in declared_precision(strict, LowDtype.parse(dtype)).fp32] == ["router.gate"]


def test_declared_fp32_modules_are_classified_fp32_with_the_reason():
    torch.manual_seed(0)
    report = ampaudit.check(_Declaring(), (torch.randn(4, 8),), config=NEVER)
    linears = {n.module: n for n in report.nodes if n.kind == "linear"}
    assert linears["blocks.0.wo"].precision.value == "fp32" and linears["blocks.1.wo"].precision.value == "fp32"
    assert linears["blocks.0.wo"].reason.startswith("the model keeps this module in fp32 "
                                                    "(_Declaring._keep_in_fp32_modules names 'wo')")
    assert linears["blocks.0.wi"].precision.value == "fp16"
    bf16 = ampaudit.check(_Declaring(), (torch.randn(4, 8),), dtype="bfloat16", config=NEVER)
    assert {n.module: n.precision.value for n in bf16.nodes if n.kind == "linear"}["blocks.0.wo"] == "fp16"


def test_an_overflow_in_a_declared_fp32_module_is_not_a_float16_overflow():
    torch.manual_seed(0)
    x = torch.randn(4, 8) * 30
    declared = ampaudit.check(_Declaring(scale=3000.0), (x,), config=NEVER)
    assert "AMP301" not in {f.rule for f in declared.findings}  # wo runs in fp32, as declared
    undeclared = _Declaring(scale=3000.0)
    undeclared._keep_in_fp32_modules = None
    report = ampaudit.check(undeclared, (x,), config=NEVER)
    assert {f.module for f in report.findings if f.rule == "AMP301"} <= {"blocks.0.wo", "blocks.1.wo"}
    assert [f for f in report.findings if f.rule == "AMP301"]


def test_bf16_pretrained_config_warns_for_float16_only():
    x = (torch.randn(4, 8),)
    report = ampaudit.check(_Declaring(dtype=torch.bfloat16), x, config=NEVER)
    (finding,) = [f for f in report.findings if f.rule == "AMP103"]
    assert finding.severity.value == "warning" and "trained in bfloat16" in finding.message
    assert "`wo`" in finding.fix  # the modules it already keeps in fp32
    assert finding.file == "tests/test_model_patterns.py" and finding.line == inspect.getsourcelines(_Declaring)[1]
    assert "AMP103" not in {f.rule for f in ampaudit.check(_Declaring(dtype=torch.bfloat16), x, dtype="bfloat16",
                                                            config=NEVER).findings}
    for trained in (None, "float32", torch.float16):
        assert "AMP103" not in {f.rule for f in ampaudit.check(_Declaring(dtype=trained), x, config=NEVER).findings}


# -- the real libraries, when they are installed ------------------------------------------------------


def test_torchvision_resnet18():
    models = pytest.importorskip("torchvision.models", reason="torchvision is an optional extra")
    torch.manual_seed(0)
    report = ampaudit.check(models.resnet18(num_classes=10), (torch.randn(2, 3, 64, 64),), config=NEVER)
    assert report.target.trace == "fx"
    assert report.summary()["errors"] == 0 and report.summary()["warnings"] == 0
    assert not {"AMP102", "AMP303"} & {f.rule for f in report.findings}


def test_timm_vit():
    timm = pytest.importorskip("timm", reason="timm is an optional extra")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                            num_classes=10, drop_path_rate=0.1)
    report = ampaudit.check(vit, (torch.randn(2, 3, 32, 32),), config=NEVER)
    assert report.summary()["errors"] == 0 and report.summary()["warnings"] == 0
    assert not {"AMP102", "AMP303"} & {f.rule for f in report.findings}
