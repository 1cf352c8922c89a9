"""ampaudit.watch: exact counts, first non-finite, loss scale, no harm, run/report, DDP."""

from __future__ import annotations

import gc
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import ampaudit
from ampaudit.core.dtypes import LowDtype
from ampaudit.core.errors import UsageError
from ampaudit.watch import conditions, reducer, stats
from ampaudit.watch.layout import LAYOUT
from ampaudit.watch.log_file import open_log
from ampaudit.watch.monitor import NonFiniteError
from ampaudit.watch.summary import read_log
from tests.conftest import ROOT

KNOWN = [70000.0, 1e-6, 0.0, 1.0, float("inf"), float("nan"), -1e5, 3e-8]


def test_row_counts_on_known_values():
    def row_of(values, dtype):
        return stats.tensor_stats(torch.tensor(values), LowDtype.parse(dtype), fill=stats.torch_fill_row)

    row = row_of(KNOWN, torch.float16)
    assert {k: row[k] for k in stats.FIELDS} == {
        "numel": 8, "nan": 1, "inf": 1, "neginf": 0, "overflow": 3, "underflow": 2, "zero": 1, "absmax": 1e5}
    # floor(log2 |x|): 70000 -> 16, 1e-6 -> -20, 1 -> 0, 1e5 -> 16, 3e-8 -> -25
    assert row["hist"] == [[-25, 1], [-20, 1], [0, 1], [16, 2]]
    bf16 = row_of(KNOWN, torch.bfloat16)
    assert (bf16["overflow"], bf16["underflow"]) == (1, 0)  # only inf; bf16 has fp32's range


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_triton_kernel_matches_the_torch_path(dtype):
    pytest.importorskip("triton", reason="triton runs the kernel in its CPU interpreter")
    code = ("import torch\nfrom ampaudit.core.dtypes import LowDtype\nfrom ampaudit.watch import stats, triton_stats\n"
            "from ampaudit.watch.layout import LAYOUT\n"
            "inf, nan = float('inf'), float('nan')\n"
            f"x = torch.tensor({[*KNOWN, -float('inf'), 1e-40, -1e-45, 2.0**-126]!r} * 2000).to(torch.{dtype})\n"
            "assert triton_stats.available()\n"  # 24000 values: 3 blocks
            "lim = LowDtype.parse(torch.float16)\n"
            "kernel, ops = stats.new_row(x.device), stats.new_row(x.device)\n"
            "triton_stats.fill_row(x, *kernel, lim.overflow_at)\n"
            "stats.torch_fill_row(x, *ops, lim)\n"
            "assert int(kernel[0][LAYOUT.count['neginf']]) == int((x == -inf).sum()) >= 2000\n"
            "assert torch.equal(kernel[0], ops[0]), (kernel[0] - ops[0]).nonzero()\n"
            "assert torch.equal(kernel[1], ops[1]), (kernel[1], ops[1])\n"
            # parameter rows: the sum of squares and the count over the loss scale, fused
            "g = torch.randn(20000, generator=torch.Generator().manual_seed(0)) * 40\n"
            "g[:3] = torch.tensor([65519.0, 65520.0, -7e4])\n"  # the last fp16 value, then Inf
            "kernel, ops = stats.new_row(g.device), stats.new_row(g.device)\n"
            "scale = torch.tensor(1024.0)\n"
            "triton_stats.fill_row(g, *kernel, lim.overflow_at, norm=True, scale=scale, limit=lim.max)\n"
            "stats.torch_fill_row(g, *ops, lim)\n"
            "stats.fill_param_extras(g, *ops, lim, norm=True, scale=scale)\n"
            "scaled = LAYOUT.count['scaled']\n"
            "assert int(kernel[0][LAYOUT.count['overflow']]) == 2\n"
            "assert torch.equal(kernel[0], ops[0]) and kernel[0][scaled] > 0, (kernel[0][scaled], ops[0][scaled])\n"
            "assert torch.allclose(kernel[1], ops[1], rtol=1e-5), (kernel[1], ops[1])\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


class _Blowup(nn.Module):
    def __init__(self, at_step: int):
        super().__init__()
        self.at_step, self.calls = at_step, 0

    def forward(self, x):
        self.calls += 1
        return x * (float("inf") if self.calls == self.at_step + 1 else 1.0)


def _net(*middle):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), *middle, nn.Linear(8, 2))


def _train(model, optimizer, steps, loss_scale=1.0):
    x = torch.ones(3, 4)
    for _ in range(steps):
        loss = model(x).pow(2).mean() * loss_scale
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _logged_run(tmp_path, steps):
    """A small watched run that writes a log; returns the log's path."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tmp_path / "run.jsonl"
    with ampaudit.watch(model, optimizer=opt, log=log):
        _train(model, opt, steps)
    return log


def test_first_nonfinite_in_forward():
    model = _net(_Blowup(at_step=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampaudit.watch(model, optimizer=opt) as mon:
        _train(model, opt, 4)
    first = mon.summary()["first_nonfinite"]
    assert {k: first[k] for k in ("step", "module", "phase", "tensor")} == {
        "step": 2, "module": "1", "phase": "forward", "tensor": "output"}
    assert "stayed finite: it depends on state" in first["note"]  # _Blowup counts its calls


class _Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x * x)  # |x|: finite forward; at 0 the gradient is inf * 0 = nan


def test_first_nonfinite_in_backward():
    model = _net(_Sqrt())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()  # layer 0 outputs exactly 0
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampaudit.watch(model, optimizer=opt) as mon:
        _train(model, opt, 1)
    # born in _Sqrt's backward (sqrt at 0): reported there, with the autograd node and its line
    first = mon.summary()["first_nonfinite"]
    assert {k: first[k] for k in ("step", "module", "phase", "tensor", "op")} == {
        "step": 0, "module": "1", "phase": "backward", "tensor": "grad of input[0]", "op": "SqrtBackward0"}
    assert first["source"] == f"{__file__}:{_Sqrt.forward.__code__.co_firstlineno + 1}"


def test_stop_on_nonfinite_names_the_module():
    model = _net(_Blowup(at_step=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with (pytest.raises(NonFiniteError, match=r"first in 1 \(forward, output\) at step 1"),
          ampaudit.watch(model, optimizer=opt, stop_on_nonfinite=True)):
        _train(model, opt, 3)
    assert not model[1]._forward_hooks  # removed on the way out


def test_gradient_underflow_in_a_starved_layer():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampaudit.watch(model, optimizer=opt) as mon:
        _train(model, opt, 1, loss_scale=1e-9)
    weight = mon.summary()["params"]["0.weight"]
    nonzero = weight["numel"] - weight["zero"]
    assert nonzero > 0 and weight["underflow"] == nonzero  # every nonzero gradient is below 6.1e-5
    assert weight["norm"] < 1e-6


def test_grad_scaler_history_and_skipped_steps(tmp_path):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    x = torch.ones(3, 4)
    with ampaudit.watch(model, optimizer=opt, scaler=scaler, log=tmp_path / "run.jsonl") as mon:
        for step in range(4):
            loss = model(x).pow(2).mean() * (float("inf") if step == 1 else 1.0)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    summary = mon.summary()
    assert summary["steps"] == 4
    assert summary["scaler"]["skipped_steps"] == [1]
    assert summary["scaler"]["history"] == [[0, 1024.0], [1, 1024.0], [2, 512.0], [3, 512.0]]
    # the scale now is the one after the last update() (growth after 2 clean steps), not the one step 3 used
    assert (summary["scaler"]["scale"], summary["scaler"]["used_last"]) == (scaler.get_scale(), 512.0) == (
        1024.0, 512.0)
    assert read_log(tmp_path / "run.jsonl").summary()["scaler"] == summary["scaler"]
    assert set(summary["scaler"]["nonfinite_params"]["1"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert summary["first_nonfinite"]["step"] == 1


def test_every_n_samples_steps():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampaudit.watch(model, optimizer=opt, every=3) as mon:
        _train(model, opt, 7)
    summary = mon.summary()
    assert summary["steps"] == 7
    assert summary["layers"]["0"]["forward"]["numel"] == 3 * 8 * 3  # steps 0, 3, 6


def test_watch_does_not_change_training_bit_for_bit():
    def run(watched: bool):
        model = _net(nn.GELU())
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
        losses, grads = [], []
        mon = ampaudit.watch(model, optimizer=opt) if watched else None
        if mon:
            mon.start()
        for _ in range(5):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            losses.append(loss.item())
        if mon:
            mon.stop()
        return losses, grads

    plain, watched = run(False), run(True)
    assert plain[0] == watched[0]
    pairs = [(a, b) for ga, gb in zip(plain[1], watched[1], strict=True) for a, b in zip(ga, gb, strict=True)]
    assert all(torch.equal(a, b) for a, b in pairs)


def test_hooks_are_removed_on_exit_and_on_exceptions():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampaudit.watch(model, optimizer=opt):
        assert model[0]._forward_hooks and opt._optimizer_step_pre_hooks
    assert not model[0]._forward_hooks and not opt._optimizer_step_pre_hooks
    with pytest.raises(RuntimeError, match="boom"), ampaudit.watch(model, optimizer=opt):
        raise RuntimeError("boom")
    assert not any(m._forward_hooks for m in model.modules()) and not opt._optimizer_step_pre_hooks


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gc.get_objects() meets torch's deprecated aliases
def test_memory_is_flat():
    # A leak of one object every 5 steps shows as 19 over the 96 measured steps: the rate the
    # bound below catches (after a warm-up that fills the step buffers and caches). Both counts
    # are whole batches of the steps judged together (conditions.BATCH): none pending at either.
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.ones(2, 4)
    with ampaudit.watch(model, optimizer=opt) as mon:
        def steps(n):
            for _ in range(n):
                loss = model(x).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
        assert conditions.BATCH == reducer.TOTALS_BATCH == 16
        steps(32)
        gc.collect()
        objects, tensors = len(gc.get_objects()), sum(isinstance(o, torch.Tensor) for o in gc.get_objects())
        steps(96)
        gc.collect()
        # growth is what leaks; fewer objects is what earlier tests left and got freed meanwhile
        assert len(gc.get_objects()) - objects < 19
        assert sum(isinstance(o, torch.Tensor) for o in gc.get_objects()) <= tensors
    assert mon.summary()["steps"] == 128


@pytest.mark.parametrize("variant", ["autocast-bf16", "autocast-fp16", "half", "convert"])
def test_works_with_mixed_precision_setups(variant):
    model = _net()
    x = torch.ones(3, 4)
    if variant == "half":
        model = model.half()
        x = x.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if variant == "convert":
        model, opt = ampaudit.convert(model, opt, (x,), verify=False, loss_scale=None)
    with ampaudit.watch(model, optimizer=opt.optimizer if variant == "convert" else opt) as mon:
        for _ in range(2):
            dtype = torch.bfloat16 if variant == "autocast-bf16" else torch.float16
            with torch.autocast("cpu", dtype=dtype, enabled=variant.startswith("autocast")):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            (opt.backward(loss) if variant == "convert" else loss.backward())
            opt.step()
    summary = mon.summary()
    assert summary["steps"] == 2 and summary["first_nonfinite"] is None
    assert summary["layers"]["0"]["forward"]["numel"] == 2 * 3 * 8


def test_log_and_report_round_trip(tmp_path, cli):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tmp_path / "run.jsonl"
    with ampaudit.watch(model, optimizer=opt, log=log) as mon:
        _train(model, opt, 3)
    lines = log.read_text().splitlines()
    assert json.loads(lines[0])["ampaudit_watch"] == 3 and len(lines) == 5  # header, one line per step, the end
    assert json.loads(lines[-1]) == {"end": {"steps": 3, "forks": 0, "eval_forwards": {"count": 0, "recorded": False},
                                             "unmeasured": {}}}
    assert read_log(log).summary() == mon.summary()
    result = cli("report", log, "--format", "json")
    assert result.json() == json.loads(json.dumps(mon.summary()))
    # A run that died mid-write: the partial last line is skipped.
    with open(log, "a") as fh:
        fh.write('{"step": 3, "lay')
    assert read_log(log).summary()["steps"] == 3
    assert "ampaudit watch" in cli("report", log).out


def test_a_log_row_holds_exactly_the_stats():
    # Format 2 writes each Stats as a flat row, its histogram a dense run of exponents.
    from ampaudit.watch.decode import log_rows
    from ampaudit.watch.stats_merge import LOG_ROW, stats_from_row

    gen = torch.Generator().manual_seed(0)
    rows = torch.zeros(6, LAYOUT.width, dtype=torch.float64)
    rows[:, :LAYOUT.hist] = torch.randint(0, 1000, (6, LAYOUT.hist), generator=gen).double()
    rows[:, LAYOUT.field["absmax"]] = torch.tensor([0.0, 1.5, 3.4e38, 6e-8, 65504.0, 1e-45], dtype=torch.float64)
    hist = rows[:, LAYOUT.hist:]
    hist[1, [0, 5, 200]] = torch.tensor([3.0, 1.0, 7.0], dtype=torch.float64)  # the fp32 subnormals, gaps in the run
    hist[2, 254] = 2**40  # the largest finite exponent; a count beyond float32's integers
    hist[3, 127:131] = 1.0
    hist[4, 255] = 9.0  # exponent 255 is Inf/NaN: no magnitude, not written
    hist[5, :255] = 1.0
    written = log_rows(rows)
    assert written[0][-1] == -127 and len(written[0]) == len(LOG_ROW)  # row 0: nothing in the histogram
    assert written[1][len(LOG_ROW) - 1:] == [-127, 3, 0, 0, 0, 0, 1] + [0] * 194 + [7]
    for row, out in zip(rows.tolist(), written, strict=True):
        assert stats_from_row(json.loads(json.dumps(out)), list(LOG_ROW)) == stats.to_stats(row)
    # rows whose runs span a few exponents read back only those: the same rows
    assert log_rows(rows[[0, 3]]) == [written[0], written[3]]
    assert log_rows(rows[[3, 1]]) == [written[3], written[1]]


@pytest.mark.parametrize("in_c", [True, False])
def test_the_log_line_is_the_record_as_json(monkeypatch, in_c):
    # LogLines writes a step's line as text, its rows by a C loop: the very bytes json.dumps
    # writes for log_record's dicts - names JSON must escape, a (module, phase) given twice, a
    # non-finite absmax and norm, empty runs, with and without a GradScaler's counts; the same
    # without the C loop (json.dumps itself)
    from ampaudit.watch import log_text
    from ampaudit.watch.decode import log_record

    if not in_c:
        monkeypatch.setattr(log_text, "_function", lambda: None)
    elif not log_text.available():
        pytest.skip("no C compiler")
    monkeypatch.setattr(log_text, "_ROOM", 16)  # the text's buffer grows while the rows do not fit
    gen = torch.Generator().manual_seed(1)
    keys = [("a", "forward"), ("a", "backward"), ('b"\\%d', "forward"), ("é", "eval"), ("a", "forward")]
    params = ["a.weight", "b%s.bias", "c\n"]
    buf = LAYOUT.step_buffer(len(keys), len(params))
    flat = torch.zeros(buf.size, dtype=torch.float64)
    rows = flat[buf.stats].view(-1, LAYOUT.width)
    rows[:, :LAYOUT.hist] = torch.randint(0, 10**6, (len(rows), LAYOUT.hist), generator=gen).double()
    rows[:, LAYOUT.hist:-1] = torch.randint(0, 3, (len(rows), LAYOUT.exponents - 1), generator=gen).double() ** 9
    rows[:, -1] = 5.0  # exponent 255 (Inf and NaN): no magnitude, never written
    rows[1, LAYOUT.hist:-1] = 0.0  # an empty run
    rows[2, LAYOUT.hist + 254] = 2.0**50  # the largest finite exponent, a count past float32's integers
    absmax = LAYOUT.field["absmax"]
    rows[:, absmax] = torch.tensor([0.0, 1e-45, float("inf"), 3.4e38, 1 / 3, float("nan"), 65504.0, 1e16])
    flat[buf.norms] = torch.tensor([float("inf"), 0.1, float("nan")])
    record = {"step": 3, "steps_seen": 4, "layers": {}, "params": {}, "scale": None, "first_nonfinite": None,
              "unmeasured": {"sparse": 1}, "dtype": "float16", "fp8": {"l": {"kind": "Linear"}}}
    lines = log_text.LogLines()
    for scaled in (-1.0, 7.0):
        flat[buf.scaled] = scaled
        expected = json.dumps(log_record(record, flat, buf, keys, params))
        assert lines.line(record, flat, buf, keys, params) == expected
        assert json.loads(expected)["layers"]["a"]["forward"][:LAYOUT.hist] == rows[4, :LAYOUT.hist].tolist()
    for no_rows in ([], keys), (params, []):  # no parameters, no modules
        buf = LAYOUT.step_buffer(len(no_rows[1]), len(no_rows[0]))
        flat = torch.zeros(buf.size, dtype=torch.float64)
        expected = json.dumps(log_record(record, flat, buf, no_rows[1], no_rows[0]))
        assert lines.line(record, flat, buf, no_rows[1], no_rows[0]) == expected


def test_the_report_counts_what_came_after_the_last_logged_step(tmp_path):
    # evaluation after the last optimizer step, and steps `every` left out at the end: the live
    # summary counted them and the log's records could not (HF Trainer said 8 eval forwards
    # live, 6 in the report)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tmp_path / "run.jsonl"
    with ampaudit.watch(model, optimizer=opt, log=log, every=2) as mon:
        _train(model, opt, 4)
        with torch.no_grad():
            model(torch.ones(1, 4))
            model(torch.ones(1, 4))
    live, read = mon.summary(), read_log(log).summary()
    assert (live["steps"], live["eval_forwards"]) == (4, {"count": 2, "recorded": False})
    assert (read["steps"], read["eval_forwards"]) == (live["steps"], live["eval_forwards"])
    assert read == live


def test_a_log_from_a_newer_ampaudit_or_with_a_bad_row_is_one_line(tmp_path, cli):
    log = _logged_run(tmp_path, steps=2)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    newer = tmp_path / "newer.jsonl"
    newer.write_text(json.dumps({**lines[0], "ampaudit_watch": 4}) + "\n")
    result = cli("report", newer)
    assert result.code == 2
    assert "a watch log of format 4, from a newer ampaudit: this one reads formats 1-3" in result.err
    lines[1]["layers"]["0"]["forward"] = "7"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = cli("report", bad)
    assert result.code == 2 and result.err.strip().endswith(
        "bad.jsonl:2: layers.0.forward: a row must be a list of numbers, one per field the header names, then "
        "histogram counts")


def test_run_attaches_to_a_plain_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\nimport torch\nfrom torch import nn\n\n"
        "torch.manual_seed(0)\nmodel = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(int(sys.argv[1])):\n"
        "    loss = model(torch.ones(2, 4)).sum() * (float('nan') if step == 2 else 1.0)\n"
        "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"
        "sys.exit(7)\n")
    log = tmp_path / "watch.jsonl"
    proc = subprocess.run([sys.executable, "-m", "ampaudit", "run", "--log", str(log), str(script), "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 7, proc.stderr  # the script's exit code
    summary = read_log(log).summary()
    assert summary["steps"] == 4
    assert set(summary["layers"]) == {"(model)", "0", "1", "2"}
    # The loss the loop computed from the model's output (times NaN) is the first non-finite tensor.
    first = summary["first_nonfinite"]
    assert {k: first[k] for k in ("step", "module", "phase", "tensor")} == {
        "step": 2, "module": "(loss)", "phase": "loss", "tensor": "loss"}
    # the weights went NaN with it: the probe, armed by it, cannot name it later, and the note says how to
    assert first["note"] == ("the loss was non-finite, made by the loop's code outside every watched module; its "
                             "gradients made the model's non-finite too (to name its line where it does not happen "
                             "again: `ampaudit run --probe-loss`, watch(probe_loss=True))")
    assert "first non-finite" in proc.stderr


DDP_SCRIPT = r'''
import sys
import torch, torch.distributed as dist
from torch import nn
import ampaudit

dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2, init_method=f"tcp://127.0.0.1:{sys.argv[2]}")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.ones(2, 4) * (float("inf") if dist.get_rank() == 1 else 1.0)
with ampaudit.watch(model.module, optimizer=opt, log=sys.argv[3] if dist.get_rank() == 0 else None) as mon:
    for step in range(3):
        out = model(x if step == 1 else torch.ones(2, 4))
        opt.zero_grad()
        out.sum().backward()
        opt.step()
dist.barrier()  # both ranks done with every collective: gloo's teardown once aborted a rank at exit
dist.destroy_process_group()
'''


def _two_processes(code: str, tmp_path, log) -> list[str]:
    """Run ``code`` as ranks 0 and 1 of a gloo group (argv: rank, port, log); their stdout."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "ranks.py"
    script.write_text(code)
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(port), str(log)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
        outs.append(out)
    return outs


def test_ddp_two_processes_one_log_and_the_rank_that_went_first(tmp_path):
    log = tmp_path / "ddp.jsonl"
    _two_processes(DDP_SCRIPT, tmp_path, log)
    summary = read_log(log).summary()
    assert summary["steps"] == 3
    first = summary["first_nonfinite"]
    assert (first["step"], first["module"], first["phase"], first["rank"]) == (1, "0", "forward", 1)
    # Counts are summed over both ranks: 2 ranks x 3 steps x 2 x 8 outputs.
    assert summary["layers"]["0"]["forward"]["numel"] == 2 * 3 * 16
    header, _ = open_log(log)
    assert header["world"] == 2 and "rank" not in header  # every record holds both ranks'


@pytest.mark.parametrize(("env", "header"), [
    ({}, {"world": 1}),
    ({"RANK": "1", "WORLD_SIZE": "2"}, {"world": 2, "rank": 1}),  # the launch's, its group not up yet
])
def test_the_log_header_names_the_run_s_processes(tmp_path, monkeypatch, env, header):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampaudit.watch(model, optimizer=opt, log=tmp_path / "w.jsonl"):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    written, _ = open_log(tmp_path / "w.jsonl")
    assert {k: written[k] for k in ("world", "rank") if k in written} == header


def test_summary_schema_is_pinned():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    x = torch.ones(3, 4)
    with ampaudit.watch(model, optimizer=opt, scaler=scaler) as mon:
        loss = model(x).sum()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    summary = mon.summary()
    assert list(summary) == ["steps", "logged_steps", "cut_short", "dtype", "first_nonfinite", "layers", "params",
                             "scaler", "unmeasured", "dtype_source", "eval_forwards", "forks", "findings"]
    assert summary["unmeasured"] == {}
    assert summary["dtype"] == "float16"
    stats_keys = ["numel", "nan", "inf", "neginf", "overflow", "underflow", "zero", "absmax", "hist"]
    for phases in summary["layers"].values():
        assert set(phases) <= {"forward", "backward", "input"}
        for s in phases.values():
            assert list(s) == stats_keys
    for p in summary["params"].values():
        assert list(p) == [*stats_keys, "norm", "overflow_at_scale"]
    assert list(summary["scaler"]) == ["scale", "used_last", "skipped_steps", "history", "nonfinite_params"]
    for f in summary["findings"]:  # check's finding schema (docs/check.md)
        assert list(f) == ["rule", "severity", "message", "file", "line", "column", "module", "node", "fix"]


def test_run_keeps_the_log_when_the_script_raises(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(
        "import torch\nfrom torch import nn\nmodel = nn.Linear(2, 2)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(3):\n    model(torch.ones(1, 2)).sum().backward()\n    opt.step()\n"
        "raise RuntimeError('diverged')\n")
    log = tmp_path / "crash.jsonl"
    proc = subprocess.run([sys.executable, "-m", "ampaudit", "run", "--log", str(log), str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "RuntimeError: diverged" in proc.stderr and "ampaudit watch" in proc.stderr
    assert read_log(log).summary()["steps"] == 3


def test_report_plot_when_matplotlib_is_there(tmp_path, cli):
    pytest.importorskip("matplotlib")
    log = _logged_run(tmp_path, steps=3)
    out = tmp_path / "plot.png"
    assert cli("report", log, "--plot", out).code == 0
    assert out.stat().st_size > 1000


def test_a_tensor_shared_by_a_container_and_its_child_is_counted_for_both():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampaudit.watch(model, optimizer=opt) as mon:
        _train(model, opt, 1)
    layers = mon.summary()["layers"]
    # "1" returns "1.0"'s output tensor itself, and the model returns it too: same numbers.
    assert layers["1"]["forward"] == layers["1.0"]["forward"] == layers["(model)"]["forward"]
    assert layers["1"]["backward"] == layers["1.0"]["backward"]
    assert layers["1.0"]["forward"]["numel"] == 3 * 2


class _TwoLinears(nn.Module):
    """The second Linear's input comes from code, not from a module: its gradient is an event of
    its own (an input gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x) * 2)


class _ReturnsItsChildsInput(nn.Module):
    """The child's input-gradient hook goes on ``y`` before the parent's output hook: the
    flags-only row made for the first must not stand in for the whole row the second needs."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(4, 4)

    def forward(self, x):
        y = x * 2
        self.child(y)
        return y


@pytest.mark.parametrize("make", [_TwoLinears, lambda: nn.Sequential(nn.Linear(4, 4), _ReturnsItsChildsInput(),
                                                                      nn.Linear(4, 2))])
def test_input_gradients_get_flags_only_rows_and_never_stand_in_for_statistics(monkeypatch, make):
    flags_only, fill_nonfinite = [], stats.fill_nonfinite
    monkeypatch.setattr(stats, "fill_nonfinite", lambda x, *row: (flags_only.append(x.shape), fill_nonfinite(x, *row)))
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # both runs see the same weights
    x = torch.randn(3, 4)
    results = []
    for provenance in (True, False):
        with ampaudit.watch(model, optimizer=opt, provenance=provenance) as mon:
            loss = model(x).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        results.append(mon.summary()["layers"])
    # the loss (flags only, each run: it is in no statistics row) and one input gradient made by no
    # module's output hook first, with provenance only
    assert flags_only == [(), (3, 4), ()]
    assert results[0] == results[1]  # and the statistics are the same either way


@pytest.mark.parametrize(("args", "message"), [
    (["run", "--log", "x.jsonl", "no_such_script.py"], "no such script: no_such_script.py"),
    (["report", "no_such_log.jsonl"], "cannot read no_such_log.jsonl"),
    (["report", "README.md"], "README.md:1: not a JSON line"),
    (["report", "fixtures/models/README.md"], "not a JSON line"),
])
def test_watch_commands_bad_input_is_one_line(cli, args, message):
    result = cli(*args)
    assert result.code == 2 and "Traceback" not in result.err
    assert result.err.startswith("ampaudit: error: ") and message in result.err
    assert len(result.err.strip().splitlines()) == 1


def test_report_refuses_a_json_file_that_is_not_a_watch_log(cli, tmp_path):
    log = tmp_path / "other.jsonl"
    log.write_text('{"hello": 1}\n')
    result = cli("report", log)
    assert result.code == 2 and "is not an ampaudit watch log" in result.err


def test_report_writes_tensorboard_scalars(tmp_path, cli):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = _net(_Blowup(at_step=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    log, out = tmp_path / "run.jsonl", tmp_path / "tb"
    with ampaudit.watch(model, optimizer=opt, scaler=scaler, log=log):
        for _ in range(3):
            loss = model(torch.ones(3, 4)).pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    result = cli("report", log, "--format", "json", "--tensorboard", out)
    assert result.code == 0 and "scalars over 3 steps" in result.err
    events = EventAccumulator(str(out))
    events.Reload()

    def series(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert series("loss_scale") == [(0, 1024.0), (1, 1024.0), (2, 512.0)]
    assert series("skipped_step") == [(0, 0.0), (1, 1.0), (2, 0.0)]
    # _Blowup multiplies its 3 x 8 input by inf at step 1: 24 Inf (or NaN, from 0 * inf) values
    assert series("nonfinite/forward/1") == [(0, 0.0), (1, 24.0), (2, 0.0)]
    assert series("overflow/forward/1")[1] == (1, 24.0)
    assert [step for step, _ in series("grad_norm/0.weight")] == [0, 1, 2]


def test_report_tensorboard_without_tensorboard_is_one_line(tmp_path, cli, monkeypatch):
    log = _logged_run(tmp_path, steps=1)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    result = cli("report", log, "--tensorboard", tmp_path / "tb")
    assert result.code == 2
    assert result.err.strip() == ("ampaudit: error: --tensorboard needs tensorboard "
                                  "(pip install 'ampaudit[tensorboard]')")


def test_param_norms_and_overflow_at_scale_are_exact():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the gradients read after are the logged ones
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14)
    x = torch.linspace(-3, 3, 12).reshape(3, 4)
    with ampaudit.watch(model, optimizer=opt, scaler=scaler) as mon:
        loss = model(x).pow(2).sum() * 40
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    params = mon.summary()["params"]
    for name, p in model.named_parameters():
        assert params[name]["norm"] == pytest.approx(float(torch.linalg.vector_norm(p.grad)), rel=1e-6)
        want = int((p.grad.abs() * 2.0**14 > 65504).sum())  # the gradients fp16 could not hold at that scale
        assert params[name]["overflow_at_scale"] == want
    assert sum(p["overflow_at_scale"] for p in params.values()) > 0  # the case is exercised
    out = io.StringIO()
    mon.print(file=out)
    header = next(line for line in out.getvalue().splitlines() if "parameter" in line and "last norm" in line)
    assert "over at scale" in header
    row = next(line for line in out.getvalue().splitlines() if line.strip("│ ").startswith("0.weight"))
    assert row.rstrip(" │").endswith(str(params["0.weight"]["overflow_at_scale"]))


def test_arena_rows_grow_by_chunks_and_reset_to_zero():
    from ampaudit.watch.arena import RowArena

    rows = RowArena(chunk=2)
    handles = []
    for value in range(5):  # three chunks
        handle, counts, extras = rows.take(torch.device("cpu"))
        counts[value] = value + 1
        extras[1] = value
        handles.append(handle)
    counts, extras = rows.matrix(handles[::-1], torch.device("cpu"))
    assert counts.shape == (5, LAYOUT.counts) and [int(counts[i, 4 - i]) for i in range(5)] == [5, 4, 3, 2, 1]
    assert extras[:, 1].tolist() == [4.0, 3.0, 2.0, 1.0, 0.0]
    rows.reset()
    handle, counts, extras = rows.take(torch.device("cpu"))
    assert handle == (torch.device("cpu"), 0) and not counts.any() and not extras.any()
    assert all(not c.any() for c in rows._devices[torch.device("cpu")].counts)


def test_arena_cpu_rows_by_address_are_the_rows_take_gives():
    from ampaudit.watch.arena import RowArena

    rows = RowArena(chunk=2)
    cpu = torch.device("cpu")
    taken = [rows.take(cpu) if i % 2 else rows.take_cpu() for i in range(5)]  # both ways, three chunks
    assert [handle for handle, *_ in taken] == [(cpu, i) for i in range(5)]
    for handle, counts, extras in taken[0::2]:  # by address: the views' own first elements
        view_counts, view_extras = rows.row(handle)
        assert (counts, extras) == (view_counts.data_ptr(), view_extras.data_ptr())
    rows.reset()
    assert rows.take_cpu()[0] == (cpu, 0)


@pytest.mark.parametrize(("flag", "needs", "message"), [
    ("--tensorboard", "tensorboard", "--tensorboard {out} is a file: name a folder"),
    ("--plot", "matplotlib", "--plot {out}: no folder {out.parent}"),
])
def test_report_outputs_that_cannot_be_written_are_one_line(tmp_path, cli, flag, needs, message):
    pytest.importorskip(needs)
    log = _logged_run(tmp_path, steps=1)
    out = tmp_path / "taken"
    out.write_text("")  # a file where TensorBoard's folder goes; the plot goes into a folder that isn't there
    out = out if flag == "--tensorboard" else tmp_path / "missing" / "plot.png"
    result = cli("report", log, flag, out)
    assert result.code == 2
    assert result.err.strip() == f"ampaudit: error: {message.format(out=out)}"


def test_device_totals_sum_each_step_as_it_comes(monkeypatch):
    # StepReducer.accumulate: runs of steps with the same keys summed in place, into the totals
    # when the keys change, every TOTALS_BATCH steps and when read: counts summed, absmax the
    # largest, as adding up every step's rows on the host gives; each step reads back its
    # parameters' finiteness and its tail, in one copy (a GPU's) or not
    from ampaudit.watch.reducer import StepReducer, _read

    monkeypatch.setattr(reducer, "TOTALS_BATCH", 3)
    gen = torch.Generator().manual_seed(0)
    absmax, nan = LAYOUT.field["absmax"], LAYOUT.field["nan"]
    shapes = {"ab": ([("a", "forward"), ("b", "forward")], ["w"]), "ba": ([("b", "forward")], ["w", "v"])}
    totals: dict[tuple, list[float]] = {}
    acc = StepReducer()
    for name in ["ab", "ab", "ba", "ab", "ab", "ab", "ab", "ba", "ba"]:
        keys, params = shapes[name]
        buf = LAYOUT.step_buffer(len(keys), len(params))
        flat = torch.randint(0, 1000, (buf.size,), generator=gen).double()
        rows = flat[buf.stats].view(-1, LAYOUT.width)
        rows[:, absmax] = torch.rand(len(rows), generator=gen, dtype=torch.float64) * 10
        rows[len(keys):, nan:nan + 2] = torch.tensor([[0.0, 0.0], [3.0, 0.0]][:len(params)])
        values = acc.accumulate(flat, buf, keys, params)
        assert values.param_nonfinite == [False, True][:len(params)]
        assert (values.norms, values.first, values.found_inf) == (flat[buf.norms].tolist(), flat[buf.first].item(),
                                                                 flat[buf.found_inf].item())
        flags = rows[len(keys):, nan:nan + 2]
        assert _read(flags, flat[buf.tail], True) == _read(flags, flat[buf.tail], False)
        for key, row in zip([("layer", *k) for k in keys] + [("param", p) for p in params], rows.tolist(),
                            strict=True):
            total = totals.setdefault(key, [0.0] * LAYOUT.width)
            totals[key] = [max(t, r) if i == absmax else t + r for i, (t, r) in enumerate(zip(total, row,
                                                                                                strict=True))]
    layers, params = acc.totals()
    for key, row in totals.items():
        got = layers[key[1]][key[2]] if key[0] == "layer" else params[key[1]]
        assert {k: v for k, v in got.items() if k in stats.to_stats(row)} == stats.to_stats(row), key


def test_ddp_reduce_sums_counts_keeps_maxima_and_the_earliest_rank(monkeypatch):
    from ampaudit.watch.reducer import StepReducer

    reducer = StepReducer(world=3)
    buf = LAYOUT.step_buffer(n_rows=2, n_params=1)
    width, absmax = LAYOUT.width, LAYOUT.field["absmax"]
    buffers = [torch.zeros(buf.size, dtype=torch.float64) for _ in range(3)]
    for rank, flat in enumerate(buffers):
        flat[buf.stats] = rank + 1  # every count and absmax
        flat[buf.row(1).start + absmax] = [5.0, 9.0, 7.0][rank]  # the second row's absmax
        flat[buf.norms], flat[buf.scaled] = [1.5, 0.5, 2.5][rank], rank + 1  # the parameter's norm, overflow at scale
        flat[buf.first] = [7.0, 4.0, 4.0][rank]  # first non-finite event: ranks 1 and 2 at event 4
        flat[buf.scale], flat[buf.found_inf] = [1024.0, 512.0, 512.0][rank], [0.0, 1.0, 0.0][rank]

    def all_gather(out, tensor):
        for dst, src in zip(out, buffers, strict=True):
            dst.copy_(src)

    monkeypatch.setattr("torch.distributed.all_gather", all_gather)
    out = reducer.gather(buffers[0], buf)
    assert out[0] == 6.0 and out[width] == 6.0  # counts: 1 + 2 + 3
    assert out[absmax] == 3.0 and out[width + absmax] == 9.0 and out[2 * width + absmax] == 3.0
    assert out[buf.norms].tolist() == [2.5] and out[buf.scaled].tolist() == [6.0]  # the largest norm; counts summed
    assert divmod(int(out[buf.first]), 3) == (4, 1)  # the earliest event, from the lowest rank that had it
    assert (out[buf.scale], out[buf.found_inf]) == (1024.0, 1.0)  # rank 0's scale; any rank's found-inf
    values = reducer.read(out, buf)
    assert len(values.layers) == 2 and values.params[0][absmax] == 3.0 and values.first == out[buf.first]


def test_every_field_reduces_as_the_layout_says_across_ranks(monkeypatch):
    # a field the layout keeps as a maximum is never summed, whatever its position
    from ampaudit.watch.layout import MAX
    from ampaudit.watch.reducer import StepReducer

    buf = LAYOUT.step_buffer(n_rows=3, n_params=2)
    buffers = [torch.full((buf.size,), float(rank + 1), dtype=torch.float64) for rank in range(2)]
    monkeypatch.setattr("torch.distributed.all_gather",
                        lambda out, tensor: [d.copy_(s) for d, s in zip(out, buffers, strict=True)])
    out = StepReducer(world=2).gather(buffers[0], buf).reshape(-1)
    rows = out[buf.stats].reshape(5, LAYOUT.width)
    for name, i in LAYOUT.field.items():
        assert rows[:, i].tolist() == [2.0 if LAYOUT.reduce[name] == MAX else 3.0] * 5, name
    assert rows[:, LAYOUT.hist:].eq(3.0).all()  # the histogram is summed


def test_report_streams_the_log_without_torch(tmp_path):
    # `ampaudit report` holds running totals only and never imports torch (whose import alone
    # is ~220 MB): a 1 GB log is read in ~20 MB (docs/benchmarks.md)
    log = _logged_run(tmp_path, steps=2)
    lines = log.read_text().splitlines()
    peaks = {}
    for count in (200, 2000):
        path = tmp_path / f"{count}.jsonl"
        with path.open("w") as out:
            out.write(lines[0] + "\n")
            for step in range(count):
                record = json.loads(lines[1])
                record["step"] = step
                out.write(json.dumps(record) + "\n")
        code = ("import sys, tracemalloc; tracemalloc.start()\n"
                "from ampaudit.watch.summary import read_log\n"
                f"summary = read_log({str(path)!r}).summary()\n"
                f"assert summary['steps'] == {count}, summary['steps']\n"
                "assert 'torch' not in sys.modules\n"
                "print(tracemalloc.get_traced_memory()[1])\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr
        peaks[count] = int(proc.stdout)
    record_size = len(lines[1])
    # 10x the records, about the same peak: the per-step history only (two numbers a step)
    assert peaks[2000] - peaks[200] < 20 * record_size, (peaks, record_size)


def test_report_names_the_bad_line_and_skips_a_partial_last_one(tmp_path):
    log = _logged_run(tmp_path, steps=3)
    text = log.read_text()
    (tmp_path / "partial.jsonl").write_text(text + '{"step": 3, "lay')
    assert read_log(tmp_path / "partial.jsonl").summary() == read_log(log).summary()
    lines = text.splitlines()
    (tmp_path / "middle.jsonl").write_text("\n".join([lines[0], lines[1], "{oops", lines[2]]) + "\n")
    with pytest.raises(UsageError, match=r"middle.jsonl:3: not a JSON line"):
        read_log(tmp_path / "middle.jsonl")


def test_a_refused_log_leaves_no_hook_behind(tmp_path):
    # the global module hooks of `ampaudit run` must not outlive a start that failed
    from torch.nn.modules import module as module_hooks

    (tmp_path / "data.jsonl").write_text('{"mine": 1}\n')
    before = (len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks))
    with pytest.raises(UsageError, match="is not an ampaudit watch log"):
        ampaudit.watch(None, log=tmp_path / "data.jsonl").start()
    assert (len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks)) == before


def _scaled_steps(model, opt, scaler, losses, *, mon_kwargs):
    x = torch.ones(3, 4)
    with ampaudit.watch(model, optimizer=opt, scaler=scaler, stop_on_nonfinite=True, **mon_kwargs) as mon:
        for factor in losses:
            loss = model(x).pow(2).mean() * factor
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return mon


def test_stop_on_nonfinite_lets_the_scaler_skip_an_overflow():
    # a gradient overflow the GradScaler skips is the scaler working: no stop
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    mon = _scaled_steps(model, opt, scaler, [1.0, 1e36, 1.0, 1.0], mon_kwargs={})
    assert mon.summary()["scaler"]["skipped_steps"] == [1]


def test_stop_on_nonfinite_stops_on_persistent_skips_and_a_collapsed_scale():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError, match=r"3 steps in a row skipped by the loss scaler \(up to step 3\)"):
        _scaled_steps(model, opt, torch.amp.GradScaler("cpu", init_scale=1024.0), [1.0] + [float("inf")] * 5,
                      mon_kwargs={"stop_after_skips": 3})
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError, match=r"the loss scale fell to 0.5 at step 0"):
        _scaled_steps(model, opt, torch.amp.GradScaler("cpu", init_scale=0.5), [1.0], mon_kwargs={})


def test_stop_on_nonfinite_stops_on_a_forward_nan_even_with_a_scaler():
    model = _net(_Blowup(at_step=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError, match=r"in the forward, which no loss scale fixes: first in 1 \(forward"):
        _scaled_steps(model, opt, torch.amp.GradScaler("cpu", init_scale=1024.0), [1.0, 1.0, 1.0], mon_kwargs={})


class _Odd(nn.Module):
    """Outputs watch cannot measure: sparse and nested tensors (complex ones are not float)."""

    def forward(self, x):
        return x.to_sparse(), torch.nested.nested_tensor([x[0], x[1, :2]]), torch.fft.fft(x)


def test_tensors_watch_cannot_measure_are_skipped_and_counted(tmp_path):
    # a sparse output, or a sparse embedding's gradient, is skipped and counted: measured, it
    # would crash the user's step ("reshape is not implemented for sparse tensors")
    import warnings

    embed = nn.Embedding(10, 4, sparse=True)
    model = nn.ModuleDict({"embed": embed, "odd": _Odd()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "run.jsonl"
    with warnings.catch_warnings(), ampaudit.watch(model, optimizer=opt, log=log) as mon:
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        for _ in range(2):
            h = model["embed"](torch.tensor([[1, 2], [3, 4]])).sum(1)
            model["odd"](h.detach())
            opt.zero_grad()
            h.pow(2).mean().backward()
            opt.step()
    summary = mon.summary()
    assert summary["unmeasured"] == {"nested": 2, "sparse": 4}  # 2 outputs + 2 embedding gradients
    assert summary["layers"]["embed"]["forward"]["numel"] == 2 * 2 * 2 * 4
    assert read_log(log).summary()["unmeasured"] == summary["unmeasured"]


@pytest.mark.parametrize(("setup", "dtype", "source"), [
    ("autocast-bf16", "bfloat16", "autocast (cpu)"),
    ("bf16-model", "bfloat16", "the model's own dtype"),
    ("fp32", "float16", "default"),
    ("given", "bfloat16", "given"),
])
def test_the_audited_dtype_is_the_one_the_run_uses(tmp_path, setup, dtype, source):
    # a bf16 run (HF bf16=True, Lightning bf16-mixed) is audited for bfloat16 without being told
    import contextlib

    model = _net()
    if setup == "bf16-model":
        model = model.bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.ones(3, 4, dtype=next(model.parameters()).dtype)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if setup == "autocast-bf16" else contextlib.nullcontext()
    log = tmp_path / "run.jsonl"
    with ampaudit.watch(model, optimizer=opt, log=log, dtype="bfloat16" if setup == "given" else None) as mon:
        for _ in range(2):
            with context:
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    summary = mon.summary()
    assert (summary["dtype"], summary["dtype_source"]) == (dtype, source)
    assert (read_log(log).summary()["dtype"], read_log(log).summary()["dtype_source"]) == (dtype, source)


class _CastLinear(torch.nn.Linear):
    """nanochat's Linear: fp32 master weights cast to the activations' dtype in forward."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight.to(x.dtype))


class _LowInside(torch.nn.Module):
    """An fp32 embedding, then the compute dtype set inside the forward: nanochat's explicit
    casts (NANOCHAT_DTYPE), or autocast entered by the model itself."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.wte = torch.nn.Embedding(8, 4)
        self.fc = _CastLinear(4, 4)

    def forward(self, idx):
        x = self.wte(idx)
        if self.how == "cast":
            return self.fc(x.to(torch.bfloat16))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.fc(x)


@pytest.mark.parametrize(("how", "source"), [("cast", "the model's own dtype"), ("autocast", "autocast (cpu)")])
def test_a_low_dtype_that_begins_inside_the_model_is_the_audited_one(tmp_path, how, source):
    """The first forward output seen (an fp32 embedding's) decided 'float16 (default)', and
    AMP601 said the run 'computes in float32', when the model goes on in bfloat16."""
    model = _LowInside(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tmp_path / "run.jsonl"
    with ampaudit.watch(model, optimizer=opt, log=log) as mon:
        for _ in range(2):
            model(torch.arange(8).view(2, 4)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    summary = mon.summary()
    assert (summary["dtype"], summary["dtype_source"]) == ("bfloat16", source)
    assert (read_log(log).summary()["dtype"], read_log(log).summary()["dtype_source"]) == ("bfloat16", source)


def _optimizer(kind, model, lr=0.01, max_iter=1):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr)
    return torch.optim.LBFGS(model.parameters(), lr=lr, max_iter=max_iter)


def _closure(model, opt, x, calls=None):
    """The closure optimizer.step(closure) takes: forward, squared loss, backward."""
    def closure():
        if calls is not None:
            calls.append(1)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    return closure


@pytest.mark.parametrize("optimizer_type", ["sgd", "lbfgs"])
def test_closure_steps_record_each_step_in_its_own_step(optimizer_type):
    # optimizer.step(closure) runs forward and backward inside step(): each record belongs to
    # that step, not one late (no empty step 0, no extra step, a NaN at step 2 reported at 2)
    model = _net(_Blowup(at_step=2))
    opt = _optimizer(optimizer_type, model)
    closure = _closure(model, opt, torch.ones(3, 4))
    with ampaudit.watch(model, optimizer=opt) as mon:
        for _ in range(4):
            opt.step(closure)
    summary = mon.summary()
    assert summary["steps"] == 4
    assert summary["first_nonfinite"]["step"] == 2 and summary["first_nonfinite"]["phase"] == "forward"
    assert summary["layers"]["0"]["forward"]["numel"] == 4 * 3 * 8  # every step's forward, none lost


class _RootMakesNan(nn.Module):
    """A NaN made by the root module's own code (between its children) at one step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)
        self.step = 0  # set by the loop: a replay of the step makes the NaN again

    def forward(self, x):
        h = self.fc1(x)
        if self.step == 2:
            h = h / 0.0 * 0.0  # the root's own line
        return self.fc2(h)


_ROOT_NAN_LINE = _RootMakesNan.forward.__code__.co_firstlineno + 3


@pytest.mark.parametrize("optimizer_type", ["sgd", "lbfgs"])
@pytest.mark.parametrize("global_hooks", [False, True])
def test_a_nan_the_root_makes_under_a_closure_step_is_blamed_on_its_line(optimizer_type, global_hooks):
    # optimizer.step(closure) (Lightning's automatic optimization): the step ended after the
    # update, and the root's replay saw NaN weights, so the NaN "came from outside" into fc2
    from ampaudit.watch.monitor import Monitor

    model = _RootMakesNan()
    opt = _optimizer(optimizer_type, model)
    closure = _closure(model, opt, torch.ones(3, 4))
    with (Monitor(None) if global_hooks else ampaudit.watch(model, optimizer=opt)) as mon:
        for model.step in range(4):
            opt.step(closure=closure) if global_hooks else opt.step(closure)
    first = mon.summary()["first_nonfinite"]
    assert (first["step"], first["phase"], first["op"]) == (2, "forward", "aten.div")
    assert first["module"] == "(model)" and first["source"] == f"{__file__}:{_ROOT_NAN_LINE}"


def test_each_closure_call_within_one_lbfgs_step_is_a_step_of_its_own():
    # LBFGS(max_iter=3) calls the closure 3 times a step, each at new weights: one watched step
    # per call, so each record is that evaluation's and a replay sees the weights it used
    model = _net(_Blowup(at_step=6))
    opt, calls = _optimizer("lbfgs", model, lr=0.1, max_iter=3), []
    closure = _closure(model, opt, torch.randn(3, 4), calls)
    with ampaudit.watch(model, optimizer=opt) as mon:
        for _ in range(4):
            opt.step(closure)
    summary = mon.summary()
    assert len(calls) == summary["steps"] == 12
    assert summary["layers"]["0"]["forward"]["numel"] == 12 * 3 * 8
    assert (summary["first_nonfinite"]["step"], summary["first_nonfinite"]["module"]) == (6, "1")


class _PlainSGD(torch.optim.Optimizer):
    """SGD that calls its closure only when ``call_closure`` says so."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.01})
        self.call_closure = True

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None and self.call_closure:
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def test_a_closure_that_raises_or_is_never_called_leaves_every_later_step_one_step():
    # a retried step (a closure that raised, caught by the loop: an OOM retry) once left its
    # closure step pending, and a later plain step ended twice; a closure the optimizer never
    # calls ends its step after step()
    model = _net()
    opt = _PlainSGD(model.parameters())
    x = torch.ones(3, 4)

    def failing():
        raise RuntimeError("out of memory (simulated)")

    with ampaudit.watch(model, optimizer=opt) as mon:
        with pytest.raises(RuntimeError, match="simulated"):
            opt.step(failing)
        for _ in range(3):  # plain steps
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.call_closure = False
        opt.step(_closure(model, opt, x))  # never called: the step ends after step()
    summary = mon.summary()
    assert summary["steps"] == 4
    assert summary["layers"]["0"]["forward"]["numel"] == 4 * 3 * 8


class _SGDThatCallsSuper(torch.optim.SGD):
    def step(self, closure=None):
        return super().step(closure)


@pytest.mark.parametrize("global_hooks", [False, True])
@pytest.mark.parametrize("with_closure", [False, True])
def test_a_subclass_step_that_calls_super_ends_one_step(global_hooks, with_closure):
    # torch wraps SGD.step with the hooks once an SGD has been made, and the subclass's step
    # too: each step ran the hooks twice and was counted as two
    from ampaudit.watch.monitor import Monitor

    torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)  # SGD.step is hooked from now on
    model = _net()
    opt = _SGDThatCallsSuper(model.parameters(), lr=0.01)
    x = torch.ones(3, 4)
    closure = _closure(model, opt, x)
    with (Monitor(None) if global_hooks else ampaudit.watch(model, optimizer=opt)) as mon:
        for _ in range(3):
            if with_closure:
                opt.step(closure)
            else:
                closure()
                opt.step()
    summary = mon.summary()
    assert summary["steps"] == 3
    assert summary["layers"]["0"]["forward"]["numel"] == 3 * 3 * 8


@pytest.mark.parametrize("record_eval", [False, True])
def test_eval_forwards_stay_out_of_the_training_statistics(record_eval):
    # nanoGPT's estimate_loss(): torch.no_grad() forwards between steps stay out of the next
    # training step's statistics (with eval=True they are recorded apart)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.ones(3, 4)
    with ampaudit.watch(model, optimizer=opt, eval=record_eval) as mon:
        for _ in range(2):
            with torch.no_grad():
                model(x * 1e6)  # a huge eval batch: would show as overflow
                model(x)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    summary = mon.summary()
    assert summary["eval_forwards"] == {"count": 4, "recorded": record_eval}
    assert summary["layers"]["0"]["forward"]["numel"] == 2 * 3 * 8  # the two training forwards only
    assert summary["layers"]["0"]["forward"]["overflow"] == 0
    assert ("eval" in summary["layers"]["0"]) is record_eval


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _global_hooks():
    from torch.nn.modules import module as module_hooks

    return len(module_hooks._global_forward_hooks), len(module_hooks._global_forward_pre_hooks)


@pytest.mark.parametrize("model_given", [True, False])  # watch(model), and ampaudit run's global hooks
def test_between_recorded_steps_only_one_hook_runs_and_eval_calls_still_count(monkeypatch, model_given):
    # every=3: the module hooks are on for steps 0, 3, 6 and off (the root's forward hook, or
    # one global hook, left to count eval calls) for the others - a Python call per module per
    # forward for nothing, on a small model most of every=10's cost
    from ampaudit.watch import hooks as watch_hooks

    monkeypatch.setattr(watch_hooks, "compiled_anything", lambda: False)  # another test may have compiled
    model = _net(nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.ones(3, 4)
    hooks_before, globals_before = _hooks(model), _global_hooks()
    seen = []
    with ampaudit.watch(model if model_given else None, optimizer=opt if model_given else None,
                        every=3) as mon:
        for _ in range(7):
            seen.append((mon.logging, _hooks(model) - hooks_before,
                         tuple(a - b for a, b in zip(_global_hooks(), globals_before, strict=True))))
            with torch.no_grad():
                model(x)  # an eval call, recorded or not: counted
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    armed = (5, (0, 0)) if model_given else (0, (1, 1))  # 4 modules + the root's pre-hook; or the global pair
    idle = (1, (0, 0)) if model_given else (0, (1, 0))
    assert seen == [(True, *armed), (False, *idle), (False, *idle), (True, *armed), (False, *idle),
                    (False, *idle), (True, *armed)]
    summary = mon.summary()
    assert summary["eval_forwards"] == {"count": 7, "recorded": False}
    assert summary["steps"] == 7 and summary["layers"]["0"]["forward"]["numel"] == 3 * 3 * 8  # steps 0, 3, 6
    assert _hooks(model) == hooks_before and _global_hooks() == globals_before


class _InnerLoop(nn.Module):
    """A model whose forward steps an optimizer of its own (a meta-learning inner loop)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        self.inner_opt = torch.optim.SGD(self.inner.parameters(), lr=0.01)

    def forward(self, x):
        with torch.enable_grad():
            loss = self.inner(x).pow(2).mean()
            self.inner_opt.zero_grad()
            loss.backward()
            self.inner_opt.step()  # under ampaudit run: a step boundary inside the outer forward
        return self.head(self.inner(x).detach())


def test_run_keeps_its_hooks_while_a_forward_is_in_flight(monkeypatch):
    # ampaudit run's global hooks count the depth of module calls (depth 0: a root, named and
    # replayed as the model); a boundary inside a forward must not swap them for the idle one,
    # whose calls count nothing: the outer call would never come back to depth 0
    from ampaudit.watch import hooks as watch_hooks

    monkeypatch.setattr(watch_hooks, "compiled_anything", lambda: False)
    model = _InnerLoop()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    depths = []
    with ampaudit.watch(None, every=2) as mon:
        for _ in range(6):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            depths.append(mon.recorder._depth)
            with torch.no_grad():
                model(x)
    assert depths == [0] * 6
    summary = mon.summary()
    assert summary["steps"] == 18  # each forward's inner step (the eval ones too) and each outer step end one
    assert summary["eval_forwards"]["count"] == 6


def test_once_torch_compile_has_run_the_hooks_stay_on(monkeypatch):
    # a compiled graph guards on its modules' hooks: taking them off and on would recompile it
    from ampaudit.watch import hooks as watch_hooks

    monkeypatch.setattr(watch_hooks, "compiled_anything", lambda: True)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampaudit.watch(model, optimizer=opt, every=3):
        counts = []
        for _ in range(4):
            counts.append(_hooks(model))
            _train(model, opt, 1)
    assert counts == [4, 4, 4, 4]


@pytest.mark.parametrize("width", [80, 120])
def test_the_summary_fits_the_terminal(width):
    # at 80 and at 120 columns the summary fits, its numeric columns show, long counts stay whole
    import io

    from rich.console import Console

    from ampaudit.watch.render import render_summary

    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampaudit.watch(model, optimizer=opt) as mon:
        _train(model, opt, 3)
    summary = mon.summary()
    summary["layers"]["1.0"]["forward"].update(nan=123456789, overflow=12)  # long counts stay whole
    out = io.StringIO()
    render_summary(summary, Console(file=out, width=width, force_terminal=False))
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= width
    assert any("123456789/0" in line for line in lines)
    row = next(line for line in lines if line.replace("│", " ").split()[:2] == ["1.0", "forward"])
    assert "16.7" in row  # overflow as a share of elements: 12 of 3 steps x 3 x 8
    assert ("log2 |x|" in out.getvalue()) is (width >= 110)


@pytest.mark.parametrize("width", [80, 110])
def test_dotted_names_break_only_after_a_dot(width):
    """Before: the module column folded ``transformer.h.0.attn.c_attn`` into 10-character
    fragments at 80 columns, and a wide terminal's table cut nanoGPT's
    ``transformer.h.0.attn.resid_dropout`` into ``...resid_dr`` and ``opout``."""
    import io

    from rich.console import Console

    from ampaudit.watch.render import render_summary

    model = nn.Sequential()
    model.add_module("transformer", nn.ModuleDict({"h": nn.ModuleList([nn.ModuleDict({"attn": nn.ModuleDict(
        {"c_attn": nn.Linear(4, 4)})})])}))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner.transformer["h"][0]["attn"]["c_attn"](x)

    net = GPT()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with ampaudit.watch(net, optimizer=opt) as mon:
        _train(net, opt, 1)
    out = io.StringIO()
    render_summary(mon.summary(), Console(file=out, width=width, force_terminal=False))
    table = out.getvalue().split("Per module")[1].split("Parameter gradients")[0]
    names, lines = [], [line.replace("│", " ") for line in table.splitlines()[3:]]
    for line in lines:
        if line.strip() and not set(line.strip()) <= set("─┃━┡╇┩└┴┘"):
            part = line.split()[0]
            names[-1:] = [names[-1] + part] if names and names[-1].endswith(".") else [*names[-1:], part]
    # broken only after a dot: every name reads whole again
    assert names.count("inner.transformer.h.0.attn.c_attn") == 2  # forward and backward
    assert set(names) == {"(model)", "inner.transformer.h.0.attn.c_attn"}
    assert max(len(line) for line in out.getvalue().splitlines()) <= width
    if width == 110:  # 33 characters at 110 columns: broken once, after "attn."
        assert sum(line.split()[0] == "c_attn" for line in lines if line.strip()) == 2


@pytest.mark.parametrize("order", ["lifo", "fifo"])
def test_two_watches_on_one_scaler_keep_their_own_steps(order):
    # each watch's stop() removes its own wrapper, whichever is on top: the other watch keeps
    # its step boundaries, and the scaler keeps no dead wrapper
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.ones(3, 4)

    def step():
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    outer = ampaudit.watch(model, optimizer=opt, scaler=scaler).start()
    inner = ampaudit.watch(model[0], optimizer=opt, scaler=scaler).start()
    step()
    step()
    first, second = (inner, outer) if order == "lifo" else (outer, inner)
    first.stop()
    step()
    second.stop()
    step()
    assert first.summary()["steps"] == 2 and second.summary()["steps"] == 3
    assert "update" not in scaler.__dict__  # the class's own update() again
    assert [h for _, h in second.summary()["scaler"]["history"]] == [1024.0] * 3



class _MaskedScores(nn.Module):
    """Attention-style scores with the future masked out: -inf, and no overflow of any other kind."""

    def forward(self, x):  # (b, t, d) -> (b, t, t)
        scores = x @ x.transpose(-1, -2)
        return scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))


@pytest.mark.parametrize("log", [False, True])  # totals kept on the device, or every step read back
def test_neginf_counts_masked_scores_exactly(tmp_path, log):
    model = nn.Sequential(nn.Linear(4, 4), _MaskedScores(), nn.Softmax(-1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "run.jsonl"
    with ampaudit.watch(model, optimizer=opt, log=path if log else None) as mon:
        for _ in range(2):
            loss = model(torch.randn(2, 3, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    layers = mon.summary()["layers"]
    masked = layers["1"]["forward"]
    assert masked["neginf"] == masked["inf"] == masked["overflow"] == 2 * 2 * 3  # 3 per 3 x 3 causal mask
    assert masked["nan"] == 0
    others = [s["neginf"] for name, phases in layers.items() for phase, s in phases.items()
              if (name, phase) != ("1", "forward")]
    assert others and not any(others)  # the softmax after it, and the gradients, hold no -inf
    if log:
        records = list(open_log(path, steps_only=True)[1])
        assert [r["layers"]["1"]["forward"]["neginf"] for r in records] == [6, 6]
        assert read_log(path).summary() == mon.summary()


def test_a_log_written_before_neginf_still_reads(tmp_path, cli):
    log = _logged_run(tmp_path, steps=2)
    header, records = open_log(log)
    old = tmp_path / "old.jsonl"
    with old.open("w") as out:  # the same log, as format 1 wrote it before the neginf field
        out.write(json.dumps({**{k: v for k, v in header.items() if k != "row"}, "ampaudit_watch": 1}) + "\n")
        for record in records:
            for stats_ in [*(s for phases in record.get("layers", {}).values() for s in phases.values()),
                           *record.get("params", {}).values()]:
                del stats_["neginf"]
            out.write(json.dumps(record) + "\n")
    assert "neginf" not in old.read_text()
    summary = read_log(old).summary()
    assert summary == read_log(log).summary()  # a missing field reads as 0
    assert all(s["neginf"] == 0 for phases in summary["layers"].values() for s in phases.values())
    result = cli("report", old, "--format", "json")
    assert result.code == 0 and result.json()["layers"]["0"]["forward"]["neginf"] == 0


def test_a_log_row_without_a_field_reads_it_as_zero(tmp_path):
    # format 2 names a row's fields in its header: a log from before a field was added still reads
    log = _logged_run(tmp_path, steps=2)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    at = lines[0]["row"].index("neginf")
    lines[0]["row"].pop(at)
    for record in lines[1:]:
        for row in [*(r for phases in record.get("layers", {}).values() for r in phases.values()),
                    *record.get("params", {}).values()]:
            row.pop(at)
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary, full = read_log(old).summary(), read_log(log).summary()
    assert all(s["neginf"] == 0 for phases in summary["layers"].values() for s in phases.values())
    for phases in full["layers"].values():  # the rest is the same
        for stats_ in phases.values():
            stats_["neginf"] = 0
    assert summary["layers"] == full["layers"]


def test_add_stats_takes_a_missing_field_as_zero_on_either_side():
    from ampaudit.watch.stats_merge import FIELDS, add_stats

    old = {"numel": 4, "nan": 1, "inf": 2, "overflow": 2, "underflow": 0, "zero": 1, "absmax": 3.0, "hist": [[1, 1]]}
    new = {**old, "neginf": 2, "absmax": 5.0}
    total = add_stats({}, old)
    assert list(total) == [*FIELDS, "hist"] and total["neginf"] == 0
    total = add_stats(total, new)
    assert (total["numel"], total["neginf"], total["absmax"], total["hist"]) == (8, 2, 5.0, [[1, 2]])
    assert add_stats(dict(new), old)["neginf"] == 2


def test_stop_on_nonfinite_records_the_step_once(tmp_path):
    # the step that raised is in the log once, its counts added once: stop() does not record it again
    model = _net(_Blowup(at_step=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tmp_path / "run.jsonl"
    with pytest.raises(NonFiniteError), ampaudit.watch(model, optimizer=opt, stop_on_nonfinite=True, log=log) as mon:
        _train(model, opt, 3)
    steps = [json.loads(line).get("step") for line in log.read_text().splitlines()[1:]]
    assert steps == [0, 1, None]  # and the end
    summary = mon.summary()
    assert summary["steps"] == 2 and summary["layers"]["0"]["forward"]["numel"] == 2 * 3 * 8
    assert read_log(log).summary()["layers"] == summary["layers"]  # (the params: their norm is NaN)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_compiled_model_trains_as_without_watch(fullgraph):
    """Under torch.compile the hooks record nothing inside the compiled region (a branch dynamo
    does not take): no graph break, fullgraph=True works, training is bit-identical, and the
    rows that are recorded (the model's output, its parameters) carry the user's names."""
    from torch._dynamo.utils import counters

    def run(watched):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 2))
        compiled = torch.compile(model, backend="eager", fullgraph=fullgraph)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        mon = ampaudit.watch(compiled, optimizer=opt) if watched else None
        if mon:
            mon.start()
        _train(compiled, opt, 3)
        if mon:
            mon.stop()
        return mon, sum(counters["graph_break"].values()), [p.detach().clone() for p in model.parameters()]

    _, breaks, plain = run(False)
    mon, watched_breaks, watched = run(True)
    assert watched_breaks == breaks == 0
    assert all(torch.equal(a, b) for a, b in zip(plain, watched, strict=True))
    summary = mon.summary()
    assert set(summary["layers"]) == {"(model)"} and summary["steps"] == 3
    assert set(summary["params"]) == {"0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"}


FSDP2_SCRIPT = r'''
import json, sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
import ampaudit

dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2, init_method=f"tcp://127.0.0.1:{sys.argv[2]}")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(1 + dist.get_rank())  # each rank its own batches
with ampaudit.watch(model, optimizer=opt, log=sys.argv[3]) as mon:
    for _ in range(2):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        full = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # collective: every rank
        opt.step()
if dist.get_rank() == 0:
    print(json.dumps({n: [g.norm().item(), g.numel()] for n, g in full.items()}))
dist.barrier()  # both ranks done with every collective: gloo's teardown once aborted a rank at exit
dist.destroy_process_group()
'''


def test_fsdp2_sharded_gradients_reduce_over_the_mesh(tmp_path):
    """FSDP2 on 2 gloo processes: each rank holds a shard of every gradient; the log's norm
    is the whole gradient's and the counts cover the whole tensor."""
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) needs torch >= 2.4")
    log = tmp_path / "fsdp2.jsonl"
    outs = _two_processes(FSDP2_SCRIPT, tmp_path, log)
    full = json.loads(outs[0].strip().splitlines()[-1])
    last = list(open_log(log, steps_only=True)[1])[-1]
    assert set(last["params"]) == set(full) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, (norm, numel) in full.items():
        assert last["params"][name]["numel"] == numel  # the two shards add up to the whole
        assert last["params"][name]["norm"] == pytest.approx(norm, rel=1e-5)  # not the local shard's


def test_a_watched_model_can_be_deep_copied_while_watched():
    # AveragedModel / an EMA copy made after the watch started deep-copies the model's hooks and,
    # through them, the recorder: its followed-thread lock raised "cannot pickle '_thread.lock'"
    import copy

    from torch.optim.swa_utils import AveragedModel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampaudit.watch(model, optimizer=opt) as monitor:
        average, twin = AveragedModel(model), copy.deepcopy(model)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            average.update_parameters(model)
        twin(torch.randn(3, 4)).sum().backward()  # the copy's hooks reach a recorder of its own
    assert monitor.summary()["steps"] == 2
    assert int(average.n_averaged) == 2


def test_with_every_the_summary_says_its_verdicts_are_of_the_logged_steps_only():
    """every=3 logs steps 0 and 3: a NaN loss at step 1 (the scaler skips it) is in neither,
    so "first non-finite: none" and "skipped steps: none" would say the run was clean."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with ampaudit.watch(model, optimizer=opt, scaler=scaler, every=3) as mon:
        for step in range(4):
            loss = model(torch.randn(2, 4)).sum() * (float("nan") if step == 1 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert scaler.get_scale() == 2.0**7  # step 1 was skipped
    summary = mon.summary()
    assert (summary["steps"], summary["logged_steps"], summary["scaler"]["skipped_steps"]) == (4, 2, [])
    out = io.StringIO()
    mon.print(out)
    text = " ".join(out.getvalue().split())
    assert "steps 4 (2 logged)" in text
    assert "first non-finite none in the logged steps" in text
    assert "skipped steps: none logged" in text


def test_a_report_of_a_log_cut_short_says_so(tmp_path, cli):
    """A log without its end line (the run killed, the disk full: `run` said "the log stops
    after step 0") read by `ampaudit report` later: its "none"s are of the steps it holds."""
    log = _logged_run(tmp_path, steps=3)
    lines = log.read_text().splitlines(keepends=True)
    assert "end" in json.loads(lines[-1])
    assert read_log(log).summary()["cut_short"] is False
    log.write_text("".join(lines[:2]) + lines[2][:40])  # the header, step 0, half of step 1
    summary = read_log(log).summary()
    assert (summary["steps"], summary["logged_steps"], summary["cut_short"]) == (1, 1, True)
    result = cli("report", str(log))
    text = " ".join(result.out.split())
    assert "log cut short: no end line (the run was stopped, or its disk full): later steps are not in it" in text
    assert "first non-finite none in the logged steps" in text


def test_an_older_log_without_an_end_line_is_not_said_to_be_cut_short(cli):
    """Formats 1 and 2 wrote a last line only with a GradScaler (its final scale): a whole log of
    a run without one - the project's own AMP605 fixture - was reported "cut short: no end line
    (the run was stopped, or its disk full)". Only format 3 ends every log with its end line."""
    log = ROOT / "fixtures" / "watch" / "AMP605_invalid.jsonl"
    assert json.loads(log.read_text().splitlines()[0])["ampaudit_watch"] == 1
    assert "step" in json.loads(log.read_text().splitlines()[-1])  # no end line
    assert read_log(log).summary()["cut_short"] is False
    assert "cut short" not in cli("report", str(log)).out


def test_a_script_that_sets_the_default_dtype_to_float64_is_measured_alike():
    """torch.set_default_dtype(torch.float64) (a scientific model in double): watch's float32
    rows were made in the default dtype, and the C kernel wrote float32 bits into float64 -
    every absmax 5e-315, every gradient norm 0."""
    def run(dtype):
        model = _net().to(dtype)  # the same weights, in the default dtype as its inputs are
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            with ampaudit.watch(model, optimizer=opt) as mon:
                _train(model, opt, 2)
        finally:
            torch.set_default_dtype(previous)
        return mon.summary()

    want, got = run(torch.float32), run(torch.float64)
    assert got["layers"]["0"]["forward"]["absmax"] == pytest.approx(want["layers"]["0"]["forward"]["absmax"], rel=1e-6)
    assert want["layers"]["0"]["forward"]["absmax"] > 0.1
    assert got["params"]["0.weight"]["norm"] == pytest.approx(want["params"]["0.weight"]["norm"], rel=1e-6)
    assert got["params"]["0.weight"]["norm"] > 0


def test_run_names_two_roots_of_one_class_apart():
    """Under ampaudit run a module called on its own is a root named by its class: a GAN's
    discriminator and an encoder, both nn.Sequential, were both `Sequential` - their rows and
    their parameters (`Sequential.0.weight`, 1x4 and 3x4) added together. A loss module made
    anew each step keeps one name."""
    torch.manual_seed(0)
    G, D, E = nn.Sequential(nn.Linear(2, 4)), nn.Sequential(nn.Linear(4, 1)), nn.Sequential(nn.Linear(4, 3))
    opt = torch.optim.SGD([*G.parameters(), *D.parameters(), *E.parameters()], lr=0.1)
    with ampaudit.watch(None) as mon:
        for _ in range(3):
            h = G(torch.randn(5, 2))
            loss = D(h).sum() + nn.MSELoss()(E(h), torch.zeros(5, 3))
            loss.backward()
            opt.step()
            opt.zero_grad()
    summary = mon.summary()
    assert sorted(summary["layers"]) == ["(model)", "0", "MSELoss", "Sequential", "Sequential#2", "Sequential#2.0",
                                         "Sequential.0"]
    params = summary["params"]
    assert (params["Sequential.0.weight"]["numel"], params["Sequential#2.0.weight"]["numel"]) == (3 * 4, 3 * 12)


class _Student(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_run_names_a_module_at_a_dead_ones_address_by_itself():
    """Under ampaudit run names were kept by id(module) and id(parameter), forever: a module
    made after another died often takes its address - the model built again for each trial of
    a sweep was taken for the dead one (never named: its Linear unrecorded, its parameters
    `param0`, `param1`), and a loss module made after another in one step carried the other's
    name (a `MSELoss` reported as `CrossEntropyLoss`). A name now lasts as long as its owner."""
    torch.manual_seed(0)
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    with ampaudit.watch(None) as mon:
        for trial in range(3):
            model = nn.Sequential(nn.Linear(4, 3)) if trial == 0 else _Student()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                out = model(x)
                loss = nn.CrossEntropyLoss()(out, y) + nn.MSELoss()(out, torch.zeros(5, 3))
                loss.backward()
                opt.step()
                opt.zero_grad()
            del model, opt, out, loss
            gc.collect()
        assert len(mon.recorder.names) == 0 and mon.recorder.names.by_id == {}  # nothing named is alive
    summary = mon.summary()
    assert sorted(summary["layers"]) == ["(model)", "0", "CrossEntropyLoss", "MSELoss", "proj"]
    assert sorted(summary["params"]) == ["0.bias", "0.weight", "proj.bias", "proj.weight"]
    # the two trials' Linears, each step: 4 steps of the students, 2 of the first model
    assert (summary["layers"]["proj"]["forward"]["numel"], summary["layers"]["0"]["forward"]["numel"]) == \
        (4 * 15, 2 * 15)
    assert summary["layers"]["MSELoss"]["forward"]["numel"] == summary["layers"]["CrossEntropyLoss"]["forward"][
        "numel"] == 6


def test_run_names_two_optimizers_unnamed_parameters_apart():
    """A module trained through ``layer.forward(x)`` runs no hook, so no module names its
    parameters (pytorch/examples' mnist_forward_forward: each layer with its optimizer). They
    were ``param<i>`` by their place in the optimizer that stepped: both layers' weights were
    ``param0``, their rows added up under one name, tensors of two sizes. Each unnamed parameter
    now has a name of its own, in the order first seen."""
    torch.manual_seed(0)
    a, b = nn.Linear(8, 6), nn.Linear(6, 4)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    x = torch.randn(16, 8)
    with ampaudit.watch(None) as mon:
        for layer, opt, inputs in ((a, opt_a, x), (b, opt_b, torch.randn(16, 6))):
            for _ in range(2):
                layer.forward(inputs).relu().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    params = mon.summary()["params"]
    assert sorted(params) == ["param0", "param1", "param2", "param3"]
    assert [params[f"param{i}"]["numel"] for i in range(4)] == [2 * 48, 2 * 6, 2 * 24, 2 * 4]


@pytest.mark.parametrize("leaf", [False, True])
def test_a_gradient_hook_of_watchs_runs_where_register_hook_would_put_it(leaf):
    """``add_grad_hook`` writes torch's own hook dict: each hook runs in the order it was
    added, ours seeing what the hooks before it returned, and a user's handle still works."""
    from ampaudit.watch.grad_hooks import add_grad_hook

    x = torch.ones(3, requires_grad=True)
    y = x if leaf else x * 2
    seen = []
    removed = y.register_hook(lambda g: seen.append("removed"))
    y.register_hook(lambda g: g * 10)  # the user's, before ours: we see its gradient
    add_grad_hook(y, lambda g: seen.append(("first", g.sum().item())))
    y.register_hook(lambda g: g + 1)  # after ours: we do not
    add_grad_hook(y, lambda g: seen.append(("second", g.sum().item())))
    removed.remove()
    y.sum().backward()
    scale = 1 if leaf else 2
    assert seen == [("first", 30.0), ("second", 33.0)]
    assert x.grad.tolist() == [11.0 * scale] * 3


def test_a_gradient_hook_on_a_fresh_tensor_is_its_first():
    from ampaudit.watch.grad_hooks import add_grad_hook

    x = torch.ones(2, requires_grad=True)
    y = x * 3
    seen = []
    add_grad_hook(y, lambda g: seen.append(g.tolist()))
    y.register_hook(lambda g: g * 0)
    y.sum().backward()
    assert seen == [[1.0, 1.0]] and x.grad.tolist() == [0.0, 0.0]


def test_the_autocast_state_a_call_is_replayed_under():
    from ampaudit.watch.provenance import autocast_state

    off = autocast_state()
    assert off == ((False, torch.get_autocast_dtype("cpu")), (False, torch.get_autocast_dtype("cuda")))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_state()[0] == (True, torch.bfloat16)
    assert autocast_state() == off


class _Table(nn.Module):  # returns its own parameter: an output that outlives the step
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(4, 8))

    def forward(self):
        return self.pos


class _Queries(nn.Module):
    """Parameters that live across steps as a module's input (DETR's query embedding, a
    Perceiver's latents) and as one's output (a position table)."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(4, 8))
        self.layer = nn.Linear(8, 8)
        self.table = _Table()

    def forward(self, x):
        return self.layer(self.query) + x.mean() + self.table()


def test_a_gradient_hook_does_not_outlive_its_step():
    """A tensor that lives across steps - a Perceiver's latents, a parameter passed to a module
    as its input - gets watch's input-gradient hook each step: it comes off at the step's end.
    Else the hooks piled up on it, and each backward ran all of them, recording every earlier
    step's events again (and its cost grew with the run)."""
    from ampaudit.watch.events import INPUT_GRAD

    torch.manual_seed(0)
    model = _Queries()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 8)
    with ampaudit.watch(model, optimizer=opt) as mon:
        for _ in range(4):
            model(x).sum().backward()
            input_grads = [e for e in mon.recorder.events if e[1] == INPUT_GRAD and e[0] == "layer"]
            assert len(input_grads) == 1  # this step's, once
            opt.step()
            opt.zero_grad()
            assert not model.query._backward_hooks and not model.table.pos._backward_hooks
        model(x).sum().backward()  # a step the watch's end cuts short: its hooks come off too
    assert not model.query._backward_hooks and not model.table.pos._backward_hooks



@pytest.mark.parametrize("mark", [False, True])
def test_a_step_skipped_by_hand_is_recorded_with_the_next_unless_marked(tmp_path, mark):
    """``if not torch.isfinite(loss): optimizer.zero_grad(); continue`` ends no step: the
    skipped iteration's forward joins the next step's record (docs/watch.md, "A step skipped by
    hand"), as gradient accumulation's micro-batches do. ``mon.step()`` in that branch ends it."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tmp_path / "run.jsonl"
    with ampaudit.watch(model, optimizer=opt, log=log) as mon:
        for it in range(5):
            x = torch.ones(3, 4)
            if it == 2:
                x[0, 0] = float("inf")
            loss = model(x).pow(2).mean()
            if not torch.isfinite(loss):
                if mark:
                    mon.step()
                opt.zero_grad()
                continue
            opt.zero_grad()
            loss.backward()
            opt.step()
    summary = mon.summary()
    records = [json.loads(line) for line in log.read_text().splitlines()[1:-1]]
    numel = [r["layers"]["0"]["forward"][0] for r in records]  # layer 0's forward elements, per step
    assert numel == ([24] * 5 if mark else [24, 24, 48, 24])
    assert summary["steps"] == len(numel)
    assert summary["first_nonfinite"]["step"] == 2 and summary["first_nonfinite"]["phase"] == "forward"


def test_a_tensor_that_outlives_a_forward_records_each_micro_batchs_gradient_once():
    """Gradient accumulation over a parameter passed to a module as its input (DETR's query
    embedding) or returned by one (a position table): each forward's event joined the tensor's
    one hook, which each backward ran whole - micro-batch k recorded the k-1 earlier ones'
    events again, 1 + 2 + 3 = 6 input-gradient events for 3, and the table's backward counted
    twice its elements."""
    from ampaudit.watch.events import INPUT_GRAD

    torch.manual_seed(0)
    model = _Queries()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampaudit.watch(model, optimizer=opt) as mon:
        for _ in range(2):
            for _ in range(3):  # micro-batches
                model(torch.randn(2, 8)).sum().backward()
            assert [e[0] for e in mon.recorder.events if e[1] == INPUT_GRAD] == ["layer"] * 3
            opt.step()
            opt.zero_grad()
    table = mon.summary()["layers"]["table"]
    assert table["backward"]["numel"] == table["forward"]["numel"] == 2 * 3 * 32


class _CheckpointedBlocks(nn.Module):
    """Blocks run under torch.utils.checkpoint, as ViTs' ``grad_checkpointing`` does."""

    def __init__(self, checkpointed: str | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(2))
        self.head, self.checkpointed = nn.Linear(8, 2), checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = x + (block(x) if self.checkpointed is None else
                     checkpoint(block, x, use_reentrant=self.checkpointed == "reentrant"))
        return self.head(x)


@pytest.mark.parametrize("global_hooks", [False, True])
def test_activation_checkpointing_records_each_module_call_once(global_hooks):
    """Non-reentrant checkpointing (torch's default) runs a block's modules again in backward,
    and stops that recomputation inside the block's last Linear, whose forward hook never runs:
    their forward rows were counted twice (a Linear's numel 384 for 192), and under ampaudit run
    the depth of module calls grew by two a block each step - never 0 again, so a root called
    later (a loss module) was never named, and with ``every`` the hooks never came off. The
    reentrant kind's forward runs without grad: its recomputation is the call recorded."""
    from ampaudit.watch.monitor import Monitor

    def run(checkpointed):
        torch.manual_seed(0)
        model = _CheckpointedBlocks(checkpointed)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 8, requires_grad=checkpointed == "reentrant")
        with (Monitor(None) if global_hooks else ampaudit.watch(model, optimizer=opt)) as mon:
            for _ in range(3):
                loss = nn.MSELoss()(model(x), torch.zeros(4, 2))
                loss.backward()
                opt.step()
                opt.zero_grad()
            assert mon.recorder._depth == 0
        summary = mon.summary()
        return {name: {phase: row["numel"] for phase, row in phases.items()}
                for name, phases in summary["layers"].items()}

    plain = run(None)
    assert plain["blocks.0.0"] == {"forward": 3 * 64, "backward": 3 * 64}
    assert run("non-reentrant") == plain
    assert run("reentrant") == plain
    assert ("MSELoss" in plain) == global_hooks


def test_run_counts_a_forward_that_raised_as_ended():
    """A forward that raises, caught by the script (a batch skipped on an out-of-memory error,
    as detection code does), never ran the global forward hook: under ampaudit run the depth of
    module calls stayed above 0 for good - a root called later was never named again, and with
    ``every`` the module hooks never came off between recorded steps."""
    from torch.nn.modules import module as module_hooks

    from ampaudit.watch.call_context import compiled_anything
    from ampaudit.watch.monitor import Monitor

    class Flaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.fail = nn.Linear(4, 4), False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.fail:
                raise RuntimeError("out of memory")
            return self.fc(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Flaky())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    armed = []
    with Monitor(None, every=2) as mon:
        for step in range(4):
            model[1].fail = step == 0
            try:
                out = model(torch.randn(2, 4))
            except RuntimeError:
                continue
            loss = nn.MSELoss()(out, torch.zeros(2, 4)) if step < 3 else nn.L1Loss()(out, torch.zeros(2, 4))
            loss.backward()
            opt.step()
            opt.zero_grad()
            armed.append(bool(module_hooks._global_forward_pre_hooks))  # the next step's hooks
        assert mon.recorder._depth == 0
    if not compiled_anything():  # after a compiled graph in this process the hooks stay on (``_rearm``)
        assert armed == [False, True, False]  # steps 1, 2, 3 ended: 2 is the one recorded
    assert sorted(mon.summary()["layers"]) == ["(model)", "0", "1", "1.fc", "L1Loss", "MSELoss"]


def test_run_names_the_trained_root_the_model_not_a_frozen_teacher_run_first():
    """Under ampaudit run the first root that ran was "(model)": DINO's EMA teacher (frozen,
    called first) or a batch augmentation module, and the student's modules were then named by
    class (`Student.proj`), the teacher's grad-disabled calls counted as the model's eval
    forwards. "(model)" is now the first root with a parameter to train."""
    from ampaudit.watch.monitor import Monitor

    class Jitter(nn.Module):  # a parameterless augmentation, called on the batch first
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 0.01

    torch.manual_seed(0)
    student, teacher, jitter = _Student(), _Student(), Jitter()
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    with Monitor(None) as mon:
        for _ in range(3):
            x = jitter(torch.randn(5, 4))
            with torch.no_grad():
                target = teacher(x).softmax(-1)
            loss = torch.sum(-target * student(x).log_softmax(-1), -1).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():  # the EMA teacher, after the step
                for t, s in zip(teacher.parameters(), student.parameters(), strict=True):
                    t.mul_(0.9).add_(0.1 * s)
    summary = mon.summary()
    assert sorted(summary["layers"]) == ["(model)", "Jitter", "proj"]
    assert sorted(summary["params"]) == ["proj.bias", "proj.weight"]
    assert summary["eval_forwards"]["count"] == 0


def test_the_loss_scale_history_costs_16_bytes_a_logged_step():
    # a million logged steps kept 136 MB of [step, scale] lists; the summary still lists them
    import tracemalloc

    from ampaudit.watch.summary import SummaryBuilder

    builder = SummaryBuilder("float16", source={"file": "x.py", "line": 1})
    record = {"layers": {}, "params": {}, "first_nonfinite": None}
    builder.add({**record, "step": 0, "scale": 65536.0})
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for step in range(1, 20_001):
        builder.add({**record, "step": step, "scale": 2.0 ** (16 - step // 5000)})
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 40 * 20_000  # arrays grow by doubling: 16 bytes a step, up to twice that
    history = builder.summary()["scaler"]["history"]
    assert len(history) == 20_001 and history[0] == [0, 65536.0] and history[-1] == [20_000, 2.0 ** 12]


def _sgd_by_hand(model: nn.Module) -> None:
    """One iteration of a loop that updates the parameters itself, no optimizer (word_language_model)."""
    model(torch.randn(16, 4)).pow(2).mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.01)
            p.grad = None


@pytest.mark.parametrize("global_hooks", [False, True], ids=["watch", "run"])
def test_a_loop_that_updates_by_hand_gets_steps_of_bounded_size(monkeypatch, capsys, global_hooks):
    """No optimizer step, GradScaler or step() ends a step in a loop that updates its
    parameters itself (`p.data.add_(p.grad, alpha=-lr)`, pytorch/examples' word_language_model):
    its one step kept every tensor's row - 2.7 MB an iteration on nanoGPT. Past OVERDUE_ROWS a
    step ends at the model's next forward, said once."""
    from ampaudit.watch import hooks
    from ampaudit.watch.monitor import Monitor

    monkeypatch.setattr(hooks, "OVERDUE_ROWS", 40)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))  # 8 rows a forward and backward
    mon = Monitor(None if global_hooks else model).start()
    most = 0
    for _ in range(30):
        _sgd_by_hand(model)
        most = max(most, mon.recorder.arena.rows_used())
    mon.stop()
    summary = mon.summary()
    assert most < 40 + 12  # the limit, and one iteration's rows
    assert mon.overdue_steps == summary["steps"] - 1 and mon.overdue_steps >= 3
    assert capsys.readouterr().err.count("no optimizer step, GradScaler or step() has ended") == 1
    assert summary["layers"]["0"]["forward"]["numel"] == 30 * 16 * 8  # every iteration recorded


@pytest.mark.parametrize("global_hooks", [False, True], ids=["watch", "run"])
def test_each_micro_batch_s_check_reads_only_its_own_rows(monkeypatch, global_hooks):
    """A forward after a backward within a step checks the rows since the last check (a
    micro-batch gone non-finite keeps its calls for a replay). Gathering every row the step has
    used to pick those out makes a hand-updated loop, whose step ends only at OVERDUE_ROWS rows,
    quadratic - pytorch/examples' regression shape, 2000 iterations: 38.8 s under `ampaudit run`
    against 2.1 s under python. Each row is checked once, the step's rows never gathered before
    its end."""
    from ampaudit.watch.arena import RowArena
    from ampaudit.watch.monitor import Monitor

    checked, gathered = [], []
    matrix, used = RowArena.matrix, RowArena.used
    monkeypatch.setattr(RowArena, "matrix", lambda self, handles, device: (
        checked.append(len(handles)), matrix(self, handles, device))[1])
    monkeypatch.setattr(RowArena, "used", lambda self, handles, device: (
        gathered.append(len(handles)), used(self, handles, device))[1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    mon = Monitor(None if global_hooks else model).start()
    for _ in range(40):
        _sgd_by_hand(model)
    rows = len(mon.recorder.event_rows)
    mon.stop()
    assert gathered == [rows]  # once, at the step's end
    assert len(checked) == 39 and sum(checked) == rows - rows // 40  # the last micro-batch's at the end


@pytest.mark.parametrize("global_hooks", [False, True], ids=["watch", "run"])
def test_a_loop_that_updates_by_hand_is_recorded_every_nth_step_with_every(monkeypatch, capsys, global_hooks):
    """With every=N the steps not recorded hold no rows, so none grew overdue: the first
    overdue step ended and the next was never recorded - 1 step in the summary for 30
    iterations (`ampaudit run --every 10` on a hand-updated loop: 1 step for 1000 iterations).
    A step not recorded ends after as many of the model's forwards as the overdue step held."""
    from ampaudit.watch import hooks
    from ampaudit.watch.monitor import Monitor

    monkeypatch.setattr(hooks, "OVERDUE_ROWS", 40)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    mon = Monitor(None if global_hooks else model, every=2).start()
    for _ in range(30):
        _sgd_by_hand(model)
    mon.stop()
    summary = mon.summary()
    # 7 rows an iteration (the loss's among them): the 7th forward ends step 0 at 42 rows, each later
    # step 6 forwards long as with every=1; steps 0, 2 and 4 recorded, 1 and 3 not
    assert (summary["steps"], mon.overdue_steps) == (5, 4)
    assert summary["layers"]["0"]["forward"]["numel"] == (6 + 6 + 6) * 16 * 8
    assert capsys.readouterr().err.count("no optimizer step, GradScaler or step() has ended") == 1
