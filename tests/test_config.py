"""[tool.ampaudit] in pyproject.toml, --select/--ignore, inline suppression, --fail-on, policies."""

from __future__ import annotations

import os
import textwrap

import pytest

from ampaudit.core.config import Config, load_config
from ampaudit.core.errors import UsageError
from ampaudit.core.finalize import suppressed_codes
from ampaudit.core.findings import FAIL_ON, Finding, Report, Severity, Target, fails_on

HEAD = '''\
"""A model whose LayerNorm output feeds var() and an unknown op."""
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
'''


def _project(tmp_path, body: str, pyproject: str | None = None):
    (tmp_path / "net.py").write_text(HEAD + textwrap.indent(textwrap.dedent(body), " " * 8))
    if pyproject is not None:
        (tmp_path / "pyproject.toml").write_text(textwrap.dedent(pyproject))
    return str(tmp_path / "net.py")


def _codes(result):
    return [(f["rule"], f["line"]) for f in result.json()["findings"]]


def test_pyproject_select_ignore_and_fail_on(cli, tmp_path):
    path = _project(tmp_path, "v = h.var()\nreturn torch.special.i0(v)\n", """
        [tool.ampaudit]
        ignore = ["AMP102"]
        fail-on = "info"
    """)
    result = cli("check", path, "--format", "json")
    assert _codes(result) == [("AMP101", 13)]
    assert result.code == 1  # fail-on info
    result = cli("check", path, "--format", "json", "--fail-on", "never", "--select", "AMP1", "--ignore", "AMP101")
    assert _codes(result) == [] and result.code == 0


def test_inline_ignore_comments(cli, tmp_path):
    path = _project(tmp_path, """\
        v = h.var()  # ampaudit: ignore[AMP101]
        w = h.std()  # ampaudit: ignore
        u = h.mean()  # ampaudit: ignore[AMP102]
        return v + w + u
    """)
    assert _codes(cli("check", path, "--format", "json")) == [("AMP101", 15)]


def test_node_rule_points_at_the_kept_finding(cli, tmp_path):
    path = _project(tmp_path, "return h.var()\n")
    nodes = {n["kind"]: n for n in cli("check", path, "--format", "json").json()["nodes"]}
    assert nodes["var"]["rule"] == "AMP101"
    assert nodes["linear"]["rule"] is None


def test_policy_in_pyproject_and_policy_file(cli, tmp_path):
    path = _project(tmp_path, "return torch.special.i0(h)\n", """
        [tool.ampaudit.policy.ops]
        special_i0 = { precision = "fp32", reason = "grows like exp" }
    """)
    doc = cli("check", path, "--format", "json").json()
    node = next(n for n in doc["nodes"] if n["kind"] == "special_i0")
    assert (node["precision"], node["reason"]) == ("fp32", "grows like exp")
    # Now known as fp32, and autocast does not upcast it: the input from fc is fp16.
    assert [(f["rule"], f["line"]) for f in doc["findings"]] == [("AMP101", 13)]

    policy = tmp_path / "policy.toml"
    policy.write_text('[ops.linear]\nprecision = "fp32"\nreason = "our accelerator has no fp16 GEMM"\n')
    doc = cli("check", path, "--format", "json", "--policy", policy).json()
    linear = next(n for n in doc["nodes"] if n["kind"] == "linear")
    assert (linear["precision"], linear["reason"]) == ("fp32", "our accelerator has no fp16 GEMM")


def test_policy_module_types_become_leaves(cli, tmp_path):
    (tmp_path / "net.py").write_text(textwrap.dedent('''\
        import torch
        from torch import nn


        class FusedNorm(nn.Module):
            def forward(self, x):
                return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm = FusedNorm()

            def forward(self, x):
                return self.norm(x)
    '''))
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent('''\
        [tool.ampaudit.policy.modules]
        FusedNorm = "rms_norm"
    '''))
    doc = cli("check", tmp_path / "net.py", "--format", "json").json()
    ops = [(n["op"], n["kind"], n["precision"], n["line"]) for n in doc["nodes"] if n["op"].startswith("call")]
    assert ops == [("call_module", "rms_norm", "fp32", 16)]


@pytest.mark.parametrize(("pyproject", "message"), [
    ('[tool.ampaudit]\nfail-on = "sometimes"\n', "fail-on must be one of"),
    ('[tool.ampaudit]\ncolour = true\n', "unknown key(s) colour"),
    ('[tool.ampaudit]\nselect = ["XYZ"]\n', "'XYZ' is not a rule code"),
    ('[tool.ampaudit.policy.ops]\nlinear = "fp64"\n', "ops.linear.precision must be one of"),
])
def test_bad_configuration_is_a_usage_error(cli, tmp_path, pyproject, message):
    path = _project(tmp_path, "return h\n", pyproject)
    result = cli("check", path)
    assert result.code == 2
    assert message in result.err and "Traceback" not in result.err


def test_config_is_found_upwards(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.ampaudit]\ndtype = "bfloat16"\n')
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    config = load_config(tmp_path / "src" / "pkg")
    assert config.dtype.name == "bfloat16" and config.source == tmp_path / "pyproject.toml"
    with pytest.raises(UsageError):
        (tmp_path / "pyproject.toml").write_text("[tool.ampaudit\n")
        load_config(tmp_path / "src")


@pytest.mark.parametrize(("line", "codes"), [
    ("x = 1", None),
    ("x = 1  # ampaudit: ignore", []),
    ("x = 1  # ampaudit: ignore[AMP101, amp2]", ["AMP101", "AMP2"]),
    ("x = 1  #ampaudit:ignore[AMP003]", ["AMP003"]),
])
def test_suppression_comment_syntax(line, codes):
    assert suppressed_codes(line) == codes


@pytest.mark.parametrize(("threshold", "fails"), [("error", False), ("warning", True), ("info", True),
                                                  ("never", False)])
def test_fail_on_is_the_least_severity_that_fails(threshold, fails):
    findings = [Finding("AMP002", Severity.WARNING, "m", "f.py", 1), Finding("AMP001", Severity.INFO, "m", "f.py", 2)]
    report = Report(Target("f.py", "", "none"), findings=findings)
    assert fails_on(findings, threshold) is fails
    assert report.fails(threshold) is fails
    assert Config(fail_on=threshold).fails(report) is fails
    assert threshold in FAIL_ON


def test_no_finding_never_fails():
    assert not any(fails_on([], threshold) for threshold in FAIL_ON)


def test_the_search_stops_at_the_project_root(tmp_path):
    (tmp_path / "pyproject.toml").write_text("this is [not toml\n")  # a broken one above the project
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "pyproject.toml").write_text("[project]\nname = 'x'\n")  # the root, without the table
    (project / "src" / "t.py").write_text("x = 1\n")
    assert load_config(project / "src" / "t.py").source is None
    (project / "pyproject.toml").unlink()
    (project / ".git").mkdir()  # a repository root without pyproject.toml stops the search too
    assert load_config(project / "src" / "t.py").source is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder another user owns")
def test_a_config_in_a_folder_others_may_write_is_not_read(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 65534, 65534)
    shared.chmod(0o1777)  # like /tmp: anyone may drop a pyproject.toml here
    (shared / "pyproject.toml").write_text('[tool.ampaudit]\nignore = ["AMP"]\n')
    (shared / "t.py").write_text("x = 1\n")
    assert load_config(shared / "t.py").source is None
    os.chown(shared, 0, 0)  # the user's own shared folder: read
    assert load_config(shared / "t.py").ignore == ["AMP"]
