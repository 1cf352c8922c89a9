"""Hazard rules work on recorded graphs as on fx graphs, and clean models stay clean."""

from __future__ import annotations

import pytest

from ampaudit.check.api import check_path
from ampaudit.core.config import Config
from tests.conftest import line_of, model


def _found(path, **kwargs):
    report = check_path(path, config=Config(select=["AMP2", "AMP3"], fail_on="never"), **kwargs)
    return report, [(f.rule, f.line) for f in report.findings]


def test_hazards_on_a_recorded_graph_sit_on_their_lines():
    path = model("hazards_untraceable.py")
    report, found = _found(path)
    assert report.target.trace == "recorder"
    assert found == [
        ("AMP201", line_of(path, "# AMP201")),
        ("AMP204", line_of(path, "# AMP204")),
        ("AMP207", line_of(path, "# AMP207")),
        ("AMP211", line_of(path, "# AMP211")),
    ]


@pytest.mark.parametrize("name", ["clean_cnn.py", "clean_transformer.py"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_clean_models_have_no_warnings_or_errors(name, dtype):
    report = check_path(model(name), dtype=dtype, config=Config(fail_on="never"))
    assert report.target.trace == "fx"
    assert any(n.measured for n in report.nodes)  # the range audit ran
    assert report.summary()["errors"] == report.summary()["warnings"] == 0, report.findings
