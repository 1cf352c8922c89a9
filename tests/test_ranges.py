"""The range audit: numbers measured against fp32, at the right line, in both low dtypes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import fx, nn

from ampaudit.check.api import check_path
from ampaudit.core.catalog import builtin_catalog
from ampaudit.core.config import Config
from ampaudit.graph.kinds import node_kind
from ampaudit.graph.range_probe import MEASURED, SHAPE, probe
from tests.conftest import RULE_FIXTURES, line_of, model


def _findings(path, dtype="float16", select="AMP3"):
    report = check_path(str(path), config=Config(select=[select], fail_on="never"), dtype=dtype)
    return [(f.rule, f.line, f.message) for f in report.findings]


def _measure(module, *args, dtype=torch.float16):
    gm = fx.symbolic_trace(module)
    catalog = builtin_catalog()
    kinds = {n: node_kind(n, gm, catalog)[0] for n in gm.graph.nodes}
    out = probe(gm, dtype, kinds, args, {})
    return gm, out


def test_overflow_is_reported_where_it_happens_with_its_numbers():
    path = RULE_FIXTURES.relative_to(RULE_FIXTURES.parents[1]) / "AMP301_invalid.py"
    (finding,) = _findings(path)
    assert finding[:2] == ("AMP301", line_of(path, "h = self.up(x)"))
    # 8 inputs x 100 x 100 plus the bias: the fp32 value, printed to 3 digits.
    assert finding[2].startswith("max |x| = 8e+04 exceeds float16 max 65504 (100% of values overflow")


def test_flush_and_precision_loss_messages():
    flush_path = RULE_FIXTURES.relative_to(RULE_FIXTURES.parents[1]) / "AMP302_invalid.py"
    ((code, _, message),) = _findings(flush_path)
    assert code == "AMP302"
    x = torch.linspace(0, 1, 64)
    p = torch.softmax(x * 50.0, -1)
    expected = float(((p > 0) & (p < 2.0 ** -25)).sum()) / 64  # below half the smallest fp16 subnormal
    assert message.startswith(f"{expected * 100:.3g}% of nonzero values flush to zero in float16")

    loss_path = RULE_FIXTURES.relative_to(RULE_FIXTURES.parents[1]) / "AMP303_invalid.py"
    ((code, _, message),) = _findings(loss_path)
    assert code == "AMP303" and message.startswith("loses 10 of 10 mantissa bits in float16")


def test_bfloat16_uses_its_own_range_and_mantissa():
    base = RULE_FIXTURES.relative_to(RULE_FIXTURES.parents[1])
    assert _findings(base / "AMP301_invalid.py", "bfloat16") == []  # 8e4 fits in bf16
    assert _findings(base / "AMP302_invalid.py", "bfloat16") == []  # bf16 keeps fp32's exponent range
    ((code, _, message),) = _findings(base / "AMP303_invalid.py", "bfloat16")
    assert code == "AMP303" and message.startswith("loses 7 of 7 mantissa bits in bfloat16")


class _Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        h = self.fc(x)
        return h * 1e-7, h * 3e4


def test_measured_statistics_match_a_direct_fp32_computation():
    torch.manual_seed(0)
    m = _Probe().eval()
    x = torch.randn(8, 64)
    gm, out = _measure(m, x)
    h = m.fc(x).detach()
    node = {n.name: n for n in gm.graph.nodes}
    fc = node["fc"].meta[MEASURED]
    assert fc.absmax == pytest.approx(float(h.abs().max()), rel=0, abs=0)
    assert fc.min_nonzero == pytest.approx(float(h.abs()[h != 0].min()), rel=0, abs=0)
    assert node["fc"].meta[SHAPE] == (8, 64)
    tiny = node["mul"].meta[MEASURED]  # h * 1e-7: mostly below fp16's subnormal range
    small = (h * 1e-7).abs()
    assert tiny.flush == pytest.approx(float((small < 2.0 ** -25).sum()) / small.numel())
    assert tiny.subnormal == pytest.approx(float(((small >= 2.0 ** -25) & (small < 2.0 ** -14)).sum()) / small.numel())
    big = node["mul_1"].meta[MEASURED]
    assert big.overflow == pytest.approx(float(((h * 3e4).abs() > 65504).sum()) / h.numel())
    torch.testing.assert_close(out[0], (h * 1e-7))  # the reference run is plain fp32


def test_emulated_error_tracks_a_real_fp16_run():
    torch.manual_seed(0)
    m = _Probe().eval()
    x = torch.randn(8, 64)
    gm, _ = _measure(m, x)
    measured = {n.name: n for n in gm.graph.nodes}["fc"].meta[MEASURED]
    ref = m.fc(x).detach()
    with torch.no_grad():
        real = nn.functional.linear(x.half(), m.fc.weight.half(), m.fc.bias.half()).float()
    real_error = float((real - ref).norm() / ref.norm())
    # Emulation (fp16 inputs, fp32 accumulation, fp16 output) is within 2x of a real fp16 kernel here.
    assert real_error / 2 <= measured.rel_error <= real_error * 2
    assert measured.bits_lost == 0 and measured.sqnr_db > 60
    assert math.isclose(measured.sqnr_db, -20 * math.log10(measured.rel_error))


def test_no_run_never_executes_the_model(cli):
    doc = cli("check", model("untraceable.py"), "--no-run", "--format", "json").json()
    assert doc["target"]["trace"] == "fx-partial"  # no recorder without running
    assert all(n["measured"] is None for n in doc["nodes"])
    assert "--no-run" in doc["target"]["notes"][-1]


def test_recorded_graphs_are_measured_too():
    report = check_path(model("untraceable.py"))
    softmax = next(n for n in report.nodes if n.kind == "softmax")
    assert softmax.measured is not None and 0 < softmax.measured["absmax"] <= 1


def test_failing_op_is_named_with_the_users_line(cli):
    result = cli("check", model("bad_inputs.py"))
    assert result.code == 2
    line = line_of(model("bad_inputs.py"), "return self.fc(x)")
    assert "fail to run the model: RuntimeError: mat1 and mat2 shapes cannot be multiplied" in result.err
    assert result.err.rstrip().endswith(f"(fixtures/models/bad_inputs.py:{line})")
