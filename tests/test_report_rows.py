"""`ampaudit report`'s fast way through a log (watch/line_shape.py, row_totals.py, columns.py,
verdicts.ColumnView): a step line proven by its shape's pattern is added up and judged from
its rows as lists - and gives the summary, the findings and the errors the slow way (a Stats
dict and a HostView per row: ``open_log`` and ``SummaryBuilder.add``) gives, byte for byte,
whatever breaks the shape."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ampaudit.core.errors import UsageError
from ampaudit.watch import verdicts
from ampaudit.watch.columns import Column
from ampaudit.watch.line_shape import LineShapes
from ampaudit.watch.log_file import open_log, open_rows
from ampaudit.watch.rule_api import GRADIENTS, REGISTRY, LayerRule, ModuleRule, Step
from ampaudit.watch.stats_merge import LOG_ROW, stats_from_row
from ampaudit.watch.summary import SummaryBuilder, read_log

MODULES = ["(model)", "0", "1", "2"]
PARAMS = ["0.weight", "0.bias", "2.weight"]


def _row(rng: random.Random, *, bad: bool = False, numel: int = 64) -> list:
    counts = [rng.choice([0, 0, 1, 3, 17, 40]) for _ in range(rng.randint(0, 12))]
    nan = 3 if bad else 0
    return [numel, nan, 1 if bad else 0, 0, rng.randint(0, 2), rng.randint(0, 30), rng.randint(0, 9),
            rng.choice([0.0, 1.5, 3.25e-3, 70000.0, rng.random()]), rng.randint(-30, 5), *counts]


def _record(rng: random.Random, step: int, modules=MODULES, params=PARAMS, *, scaled: bool = False) -> dict:
    bad = step % 5 == 3
    record = {"step": step, "steps_seen": step + 1,
              "layers": {m: {"backward": _row(rng, bad=bad), "forward": _row(rng, bad=bad)} for m in modules},
              "params": {p: _row(rng, bad=bad and p == "0.bias") for p in params},
              "scale": 1024.0 if scaled else None, "skipped": scaled and bad,
              "first_nonfinite": {"step": step, "module": "1", "phase": "forward", "tensor": "output"} if bad else None,
              "nonfinite_params": ["0.bias"] if scaled and bad else [], "dtype": "float16", "dtype_source": "default",
              "norms": {p: rng.random() for p in params}}
    if scaled:
        record["overflow_at_scale"] = {p: rng.randint(0, 3) for p in params}
    return record


def _write(path: Path, records: list, lines: tuple[tuple[int, str], ...] = (), end: bool = True) -> Path:
    """A format-3 log of ``records`` (written as the watch writes them, json.dumps), with the
    raw ``lines`` put in at their places."""
    texts = [json.dumps({"ampaudit_watch": 3, "dtype": "float16", "row": list(LOG_ROW)})]
    texts += [json.dumps(r) for r in records]
    for at, text in lines:
        texts.insert(at, text)
    if end:
        texts.append(json.dumps({"end": {"steps": 100, "forks": 0, "eval_forwards": {"count": 0, "recorded": False},
                                         "unmeasured": {}}}))
    path.write_text("\n".join(texts) + "\n")
    return path


def _slow(path: Path) -> dict:
    return _slow_builder(path).summary()


def _slow_builder(path: Path) -> SummaryBuilder:
    """The summary's builder the slow way: every row a Stats dict (open_log), every record add()ed."""
    header, records = open_log(path)
    builder = SummaryBuilder(header["dtype"], source={"file": str(path), "line": 0})
    builder.cut_short = True
    for record in records:
        builder.add(record)
        if "step" not in record:
            builder.cut_short = False
    return builder


def _fast_lines(path: Path) -> int:
    _, records = open_rows(path)
    return sum(matched is not None for _, matched in records)


def _same(path: Path) -> dict:
    fast_builder, slow_builder = read_log(path), _slow_builder(path)
    fast, slow = fast_builder.summary(), slow_builder.summary()
    assert json.dumps(fast) == json.dumps(slow)  # key order and float text included
    # the verdicts' rows too, in their order: what a rule's report reads (steps seen included)
    assert list(fast_builder.verdicts.rows.items()) == list(slow_builder.verdicts.rows.items())
    return fast


def _steps(n: int, seed: int = 0, **kwargs) -> list:
    rng = random.Random(seed)
    return [_record(rng, step, **kwargs) for step in range(n)]


@pytest.mark.parametrize("scaled", [False, True])
def test_a_log_of_one_shape_is_read_the_fast_way_with_the_slow_ways_summary(tmp_path, scaled):
    log = _write(tmp_path / "run.jsonl", _steps(12, scaled=scaled))
    assert _fast_lines(log) == 12
    summary = _same(log)
    assert summary["logged_steps"] == 12 and summary["findings"]  # NaN steps: AMP605 at least
    assert "overflow_at_scale" in summary["params"]["0.bias"] if scaled else True


def test_a_module_appearing_mid_run_and_one_missing_for_a_step(tmp_path):
    records = _steps(4) + _steps(4, seed=1, modules=[*MODULES, "3"], params=[*PARAMS, "3.weight"])
    records += _steps(3, seed=2, modules=MODULES[:2], params=PARAMS[1:])
    for step, record in enumerate(records):
        record["step"] = step
    log = _write(tmp_path / "run.jsonl", records)
    assert _fast_lines(log) == len(records)  # three shapes, each compiled
    summary = _same(log)
    assert list(summary["layers"]["3"]) == ["backward", "forward"]


def test_the_overflow_count_and_the_norm_keep_add_s_order_when_the_scaler_comes_and_goes(tmp_path):
    records = _steps(3) + _steps(3, seed=1, scaled=True) + _steps(2, seed=2)
    for step, record in enumerate(records):
        record["step"] = step
    log = _write(tmp_path / "run.jsonl", records)
    summary = _same(log)
    assert list(summary["params"]["0.weight"])[-2:] == ["overflow_at_scale", "norm"]


@pytest.mark.parametrize(("change", "fast"), [
    (lambda r: r["layers"]["1"]["forward"].__setitem__(10, 1.5), False),  # a float count
    (lambda r: r["layers"]["1"]["forward"].__setitem__(9, 2**64 - 1), False),  # 20 digits, still a number
    (lambda r: r["layers"]["1"]["forward"].__setitem__(9, -4), False),  # a negative count
    (lambda r: r["layers"]["1"]["forward"].__setitem__(7, float("nan")), False),  # a NaN absmax
    (lambda r: r["layers"]["1"]["forward"].__setitem__(0, 64.0), False),  # numel as a float
    (lambda r: r["layers"]["1"]["forward"].__setitem__(8, -1000), False),  # hist_from of 4 digits
    (lambda r: r["layers"]["1"].pop("backward"), True),  # a missing key: another shape
    (lambda r: r.pop("norms"), True),  # no norms: each norm None
])
def test_a_line_that_breaks_the_shape_gives_the_slow_ways_summary(tmp_path, change, fast):
    records = _steps(8)
    records[4]["layers"]["1"]["forward"] = [64, 0, 0, 0, 0, 2, 1, 0.5, -3, 4, 0, 6]
    change(records[4])
    log = _write(tmp_path / "run.jsonl", records)
    assert _fast_lines(log) == (8 if fast else 7)
    _same(log)


def test_a_repeated_layers_key_is_read_as_json_reads_it(tmp_path):
    records = _steps(5)
    text = json.dumps(records[2])
    other = json.dumps(_steps(1, seed=9)[0]["layers"])
    log = _write(tmp_path / "run.jsonl", records[:2] + records[3:],
                 lines=((3, text[:-1] + ', "layers": ' + other + "}"),))
    assert _fast_lines(log) == 4  # the line with two: the slow way, which takes the last
    _same(log)


@pytest.mark.parametrize(("bad", "said"), [
    ("2**64", "layers.1.forward: a row must be a list of numbers"),
    ("true", "layers.1.forward: a row must be a list of numbers"),
    ('"7"', "layers.1.forward: a row must be a list of numbers"),
    ("null", "layers.1.forward: a row must be a list of numbers"),
])
def test_a_bad_number_is_the_same_error_naming_its_line(tmp_path, bad, said):
    records = _steps(6)
    records[3]["layers"]["1"]["forward"] = [987654, 0, 0, 0, 0, 2, 1, 0.5, -3, 4, 0, 6]
    text = json.dumps(records[3]).replace("[987654, ", "[" + (str(2**64 + 1) if bad == "2**64" else bad) + ", ")
    log = _write(tmp_path / "run.jsonl", records[:3] + records[4:], lines=((4, text),))
    with pytest.raises(UsageError) as fast:
        read_log(log)
    with pytest.raises(UsageError) as slow:
        _slow(log)
    assert str(fast.value) == str(slow.value)
    assert str(fast.value).startswith(f"{log}:5: {said}")


def test_a_partial_last_line_is_skipped_and_a_bad_line_elsewhere_named(tmp_path):
    records = _steps(5)
    cut = json.dumps(_steps(1, seed=3)[0])[:-40]
    log = _write(tmp_path / "run.jsonl", records, lines=((6, cut),), end=False)
    summary = _same(log)
    assert (summary["logged_steps"], summary["cut_short"]) == (5, True)
    log = _write(tmp_path / "mid.jsonl", records, lines=((3, cut),))
    with pytest.raises(UsageError, match=r"mid.jsonl:4: not a JSON line"):
        read_log(log)


def test_the_shape_pattern_takes_only_what_the_fast_readers_take():
    shapes = LineShapes(list(LOG_ROW))
    record = _steps(1)[0]
    line = json.dumps(record)
    assert shapes.match(line, record) is not None
    compact = json.dumps(record, separators=(",", ":"))  # another spacing: not this shape's text
    assert shapes.match(compact, json.loads(compact)) is None
    assert LineShapes([*LOG_ROW[:-2], "hist_from"]).match(line, record) is None  # another row


def _views(rows, phases):
    stats = [stats_from_row(row, list(LOG_ROW)) for row in rows]
    below: dict = {}
    hosts = [verdicts.HostView(s, p, below) for s, p in zip(stats, phases, strict=True)]
    return verdicts.ColumnView(rows, phases, {}), hosts


@pytest.mark.parametrize("scale", [None, 1024.0, 0.0, 2.0**-20])
def test_every_rule_s_condition_is_the_same_on_columns_and_one_tensor_at_a_time(scale):
    rng = random.Random(4)
    rows = [_row(rng, bad=i % 3 == 0, numel=rng.choice([0, 64])) for i in range(30)]
    phases = [rng.choice(["forward", "backward"]) for _ in rows]
    step = Step(verdicts.LowDtype.parse("float16"), scale, skipped=False)
    for code, cls in sorted(REGISTRY.load().items()):
        if not issubclass(cls, ModuleRule):
            continue
        unit = cls()
        if isinstance(unit, LayerRule):
            columns, hosts = _views(rows, phases)
            got = [list(c) if isinstance(c, Column) else [c] * len(rows) for c in unit.condition(columns, step)]
            want = [list(c) for c in zip(*(unit.condition(h, step) for h in hosts), strict=True)]
        else:
            columns, hosts = _views(rows, [GRADIENTS] * len(rows))
            sums = [list(c) for c in unit.step_sums(columns, step)]
            want_sums = [list(c) for c in zip(*(unit.step_sums(h, step) for h in hosts), strict=True)]
            assert sums == want_sums, code
            at = Step(step.limits, scale, sums=tuple(sum(c) for c in sums))
            got = [list(c) if isinstance(c, Column) else [c] * len(rows) for c in unit.measure(columns, at)]
            want = [list(c) for c in zip(*(unit.measure(h, at) for h in hosts), strict=True)]
        assert got == want, code


def test_a_rule_not_written_for_columns_is_run_tensor_by_tensor(tmp_path, monkeypatch):
    calls = []

    def scalar_only(self, s, step):  # `if` on a value: a Column has no truth value
        calls.append(type(s).__name__)
        if s.nan > 0:
            return (True, s.nan, s.numel)
        return (False, 0, s.numel)

    layer = next(cls for cls in REGISTRY.load().values() if issubclass(cls, LayerRule))
    log = _write(tmp_path / "run.jsonl", _steps(6))
    want = _slow(log)
    monkeypatch.setattr(layer, "condition", scalar_only)
    got, slow = read_log(log).summary(), _slow(log)
    assert json.dumps(got) == json.dumps(slow) != json.dumps(want)
    assert "HostView" in calls and "ColumnView" in calls
