"""The model audit lints every custom autograd Function the model applies (check/function_audit.py):
improved-diffusion's recomputing checkpoint lives in a file that never mentions autocast, so the
lint alone (AMP415 asks it of files that use autocast) said nothing - and under autocast its
backward fails (tests/test_convert_function_backward.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import ampaudit
import ampaudit.core.errors
from ampaudit.core.config import Config
from ampaudit.graph.function_apply import functions_applied
from tests.conftest import line_of, model

RECOMPUTE = model("recompute_checkpoint.py")


def test_the_audit_reports_a_recomputing_function_the_lint_alone_misses(cli):
    lint = cli("check", RECOMPUTE, "--lint-only", "--format", "json")
    assert json.loads(lint.out)["findings"] == []  # the file never uses autocast
    result = cli("check", RECOMPUTE, "--format", "json")
    findings = [f for f in json.loads(result.out)["findings"] if f["rule"] == "AMP415"]
    assert [(f["file"], f["line"]) for f in findings] == [(RECOMPUTE, line_of(RECOMPUTE, "class Recompute("))]
    assert "`Recompute` lacks @torch.amp.custom_fwd/custom_bwd on forward and backward" in findings[0]["message"]


def test_functions_that_keep_their_dtype_or_declare_it_are_not_reported():
    # a straight-through round (no op autocast casts) and an RMSNorm under custom_fwd/custom_bwd
    report = ampaudit.check(*_loaded("straight_through.py"), config=Config(fail_on="never"))
    assert not [f for f in report.findings if f.rule == "AMP415"]


def test_a_function_in_a_file_using_autocast_is_reported_once(tmp_path, cli):
    path = tmp_path / "net.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class Mm(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x, w):\n        ctx.save_for_backward(x, w)\n        return x @ w\n\n"
        "    @staticmethod\n    def backward(ctx, g):\n        x, w = ctx.saved_tensors\n"
        "        return g @ w.t(), x.t() @ g\n\n\n"
        "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.w = nn.Parameter(torch.randn(4, 4))\n\n    def forward(self, x):\n"
        "        return Mm.apply(x, self.w)\n\n\n"
        "def step(net, x):\n    with torch.autocast('cpu', dtype=torch.bfloat16):\n        return net(x).sum()\n\n\n"
        "def example_inputs():\n    return (torch.randn(2, 4),)\n")
    result = cli("check", path, "--format", "json")
    found = [(f["rule"], f["line"]) for f in json.loads(result.out)["findings"]]
    assert found == [("AMP415", 5)]  # the lint and the audit: one finding


def test_the_observer_sees_each_function_once_with_its_callers_line_and_only_in_its_block():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.ones(2, requires_grad=True)
    with functions_applied() as seen:
        Twice.apply(x)  # noted here
        Twice.apply(x)
        nn.functional.linear(x, torch.ones(2, 2))  # torch's own ops: no Function of the user's
    Twice.apply(x)
    assert list(seen) == [Twice] and seen[Twice].line == line_of(__file__, "# noted" + " here")
    assert torch.autograd.Function.__dict__["apply"] is _APPLY


_APPLY = torch.autograd.Function.__dict__["apply"]


def _loaded(name):
    from ampaudit.load.loader import load_target

    loaded = load_target(model(name))
    return loaded.model, loaded.inputs


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_a_function_whose_file_cannot_be_read_again_is_skipped(tmp_path, monkeypatch):
    # read_text raises LoadError (not OSError) for a file Python would refuse now: the audit
    # goes on without that class rather than failing
    import importlib

    from ampaudit.check.function_audit import applied_function_findings

    path = tmp_path / "fn_mod.py"
    path.write_text("import torch\n\n\nclass Mm(torch.autograd.Function):\n"
                    "    @staticmethod\n    def forward(ctx, x, w):\n        return x @ w\n\n"
                    "    @staticmethod\n    def backward(ctx, g):\n        return g, g\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("fn_mod")
    assert len(applied_function_findings({module.Mm: None})) == 1
    text = path.read_bytes()
    path.write_bytes(text + b"# \x00\n")  # inspect's own parse of it raises SyntaxError
    assert applied_function_findings({module.Mm: None}) == []
    path.write_bytes(text)

    def refused(_path):
        raise ampaudit.core.errors.LoadError("not text")

    monkeypatch.setattr("ampaudit.check.function_audit.read_text", refused)
    assert applied_function_findings({module.Mm: None}) == []
