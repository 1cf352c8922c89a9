"""``ampaudit run script.py`` trains exactly as ``python script.py`` would: the script's argv,
exit code and output are its own, whatever it does to the streams or names its modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ampaudit.cli.run_cmd import split_script_args
from ampaudit.watch.log_file import open_log
from tests.conftest import ROOT

ARGV_SCRIPT = "import json, sys\nopen('argv.json', 'w').write(json.dumps(sys.argv[1:]))\n"


@pytest.mark.parametrize(("command", "script_args"), [
    (["s.py", "--", "--x", "a"], ["--", "--x", "a"]),  # python s.py -- --x a
    (["s.py", "a", "--", "b"], ["a", "--", "b"]),
    (["--every", "2", "s.py", "--x", "--", "y"], ["--x", "--", "y"]),
    (["--every=2", "s.py", "--"], ["--"]),
    (["--", "s.py", "--", "z"], ["--", "z"]),  # the first -- ends run's options, as for any command
    (["--log", "w.jsonl", "s.py", "--log", "x"], ["--log", "x"]),  # an option's value is not the script
    (["--log-file", "w.jsonl", "s.py", "--log", "x"], ["--log", "x"]),  # nor its other spelling's
    (["--dt", "bfloat16", "s.py"], []),  # an abbreviation argparse takes (--dtype) takes its value too
])
def test_the_script_gets_its_arguments_exactly_as_python_gives_them(cli, tmp_path, monkeypatch, command, script_args):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text(ARGV_SCRIPT)
    assert split_script_args(["run", *command])[1] == script_args
    if "--log" not in command:
        command = ["--log", "w.jsonl", *command]
    assert cli("run", *command).code == 0
    assert json.loads((tmp_path / "argv.json").read_text()) == script_args


def test_a_run_without_a_script_is_left_to_argparse():
    assert split_script_args(["run", "--every", "2"]) == (["run", "--every", "2"], None)
    assert split_script_args(["run", "--help"]) == (["run", "--help"], None)


MARKUP_MODEL = """
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleDict({"[/bold]": nn.Linear(4, 4), "[red]x": nn.Linear(4, 4)})

    def forward(self, x):
        return self.heads["[red]x"](self.heads["[/bold]"](x)) * float("inf")

m = M()
m(torch.ones(2, 4)).sum().backward()
print("trained")
"""


def test_rich_markup_in_module_names_is_printed_as_text(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text(MARKUP_MODEL)
    result = cli("run", "--log", "w.jsonl", "s.py")
    assert result.code == 0 and result.out == "trained\n"
    assert "heads.[/bold]" in result.err and "heads.[red]x" in result.err  # the names, as named
    report = cli("report", "w.jsonl")
    assert "heads.[/bold]" in report.out + report.err and "MarkupError" not in report.out + report.err


def test_a_newline_in_a_module_name_keeps_its_table_row(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text(MARKUP_MODEL.replace('"[red]x"', '"a\\nb\\tc"'))
    result = cli("run", "--log", "w.jsonl", "s.py")
    assert result.code == 0 and result.out == "trained\n"
    report = cli("report", "w.jsonl").out
    rows = [line for line in report.splitlines() if "heads.a" in line]
    # one row per phase, the name escaped on each (no optimizer: no parameter table)
    assert len(rows) == 2 and all("heads.a\\nb\\tc" in row for row in rows), report
    assert not any(line.lstrip("│ ").startswith("b") for line in report.splitlines())


@pytest.mark.parametrize("what", ["sys.stderr.close()", "sys.stderr = io.StringIO()", "sys.stderr = None"])
def test_a_script_that_closes_or_replaces_stderr_keeps_its_exit_code_and_gets_the_summary(tmp_path, what):
    (tmp_path / "s.py").write_text(f"import io, sys\nimport torch\n"
                                   f"torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()\n"
                                   f"print('trained')\n{what}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "ampaudit", "run", "--log", "w.jsonl", "s.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    assert (proc.returncode, proc.stdout) == (0, "trained\n"), proc.stderr
    assert "ampaudit watch" in proc.stderr and "log written to" in proc.stderr  # on the stream saved at start


def test_a_full_disk_stops_the_log_not_the_training(tmp_path):
    # `ulimit -f`: the log's writes fail with EFBIG from some step on; the script trains to the
    # end with its own exit code and output, and the summary says where the log stops
    import resource

    (tmp_path / "s.py").write_text("import torch\n"
                                   "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))\n"
                                   "opt = torch.optim.SGD(m.parameters(), lr=0.01)\n"
                                   "for step in range(30):\n"
                                   "    m(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad()\n"
                                   "print('trained', step)\nraise SystemExit(3)\n")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, 6000))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "ampaudit", "run", "--log", "w.jsonl", "s.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env, preexec_fn=limit)
    assert (proc.returncode, proc.stdout) == (3, "trained 29\n"), proc.stderr
    assert proc.stderr.count("could not be written (File too large): logging stopped, training goes on") == 1
    last = json.loads((tmp_path / "w.jsonl").read_text().splitlines()[-2])["step"]  # the last line is cut short
    assert f"the log w.jsonl stops after step {last}: File too large" in proc.stderr
    assert "│ steps             30" in proc.stderr  # the totals count every step


def test_the_magnitude_sparkline_keeps_to_its_width():
    from ampaudit.watch.render import _sparkline

    assert _sparkline([[-3, 1], [-2, 4], [0, 2]]) == "▂█ ▄"  # one character per exponent when they fit
    wide = _sparkline([[-149, 5], [-20, 1], [0, 10], [15, 3]])  # subnormals to past fp16's max
    assert len(wide) == 15 and wide[0] != " " and wide[-1] != " "


# Hogwild-shaped: one step in the parent, then a fork pool and an os.fork() child, all training.
# Sizes and a loss (mse) whose ops never start torch's OpenMP pool in the parent, so plain python
# finishes: before watch/forks.py the children hung in watch's own index_add_ on that pool.
FORK_SCRIPT = """
import os, sys, torch, torch.nn as nn, multiprocessing as mp
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
def train(n):
    for _ in range(n):
        x = torch.randn(16, 20); y = nn.functional.one_hot(torch.randint(0, 10, (16,)), 10).float()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
    return round(float(loss.detach()), 6)
def task(n):  # from the same weights and seed whichever worker takes it (one may take both)
    model.load_state_dict(start); torch.manual_seed(1)
    return train(n)
train(3)
start = {k: v.clone() for k, v in model.state_dict().items()}
with mp.get_context("fork").Pool(2) as pool:
    print(pool.map(task, [4, 4]))
pid = os.fork()
# one write each: under PYTHONUNBUFFERED print writes its words one by one, and the two processes interleave
sys.stdout.write(f"{'child' if pid == 0 else 'parent'} {train(4)}\\n"); sys.stdout.flush()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
torch.save(model.state_dict(), "weights.pt")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forking_trainer_trains_under_run_as_it_does_plainly(tmp_path):
    import time

    import torch
    (tmp_path / "s.py").write_text(FORK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}  # a pool to deadlock on
    env.pop("PYTEST_XDIST_WORKER", None)

    def run(*command):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, *command], cwd=tmp_path, capture_output=True, text=True,
                              timeout=90, env=env)
        return proc, time.perf_counter() - start

    plain, plain_s = run("s.py")
    assert plain.returncode == 0, plain.stderr
    expected = torch.load(tmp_path / "weights.pt")
    watched, watched_s = run("-m", "ampaudit", "run", "--log", "w.jsonl", "s.py")
    assert watched.returncode == 0, watched.stderr
    assert sorted(watched.stdout.splitlines()) == sorted(plain.stdout.splitlines())
    weights = torch.load(tmp_path / "weights.pt")
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    # the parent's 7 steps watched; the 3 forks (pool workers, the os.fork child) counted, not watched
    assert "3 processes forked while watching" in watched.stderr
    records = [json.loads(line) for line in (tmp_path / "w.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "step" in r] == list(range(7))  # the children wrote nothing
    assert [r["forks"] for r in records if "step" in r] == [0, 0, 0, 3, 3, 3, 3]
    assert watched_s < 1.5 * plain_s + 10  # the interpreter and ampaudit's imports on top


def _plain_and_run(tmp_path, entry=("-m", "ampaudit")) -> tuple[subprocess.CompletedProcess, ...]:
    """``s.py`` in ``tmp_path`` run by python, then by ``ampaudit run --log w.jsonl``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plain = subprocess.run([sys.executable, "s.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    watched = subprocess.run([sys.executable, *entry, "run", "--log", "w.jsonl", "s.py"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120, env=env)
    return plain, watched


@pytest.mark.parametrize("entry", [["-m", "ampaudit"], ["-c", "import sys; from ampaudit.cli.main import main; "
                                                             "sys.exit(main())"]])
def test_a_script_interrupted_ends_as_python_ends_it(tmp_path, entry):
    """Python ends on an uncaught KeyboardInterrupt (Ctrl-C) killed by SIGINT, after the
    script's atexit handlers: a shell loop around it stops. An exit code 130 made the shell go
    on to the next command, as if the script had handled Ctrl-C itself."""
    (tmp_path / "s.py").write_text("import atexit, torch\n"
                                   "atexit.register(print, 'atexit ran')\n"
                                   "torch.nn.Linear(2, 2)(torch.ones(1, 2))\n"
                                   "print('trained', flush=True)\n"
                                   "raise KeyboardInterrupt\n")
    plain, watched = _plain_and_run(tmp_path, entry)
    assert (plain.returncode, plain.stdout) == (-2, "trained\natexit ran\n")
    assert (watched.returncode, watched.stdout) == (plain.returncode, plain.stdout), watched.stderr
    assert watched.stderr.endswith("ampaudit run: log written to w.jsonl\n")
    # python's traceback of the interrupt, once: the process's own end by SIGINT prints none
    assert watched.stderr.startswith(plain.stderr) and watched.stderr.count("Traceback") == 1


def test_a_second_interrupt_during_run_s_own_end_still_ends_as_python_ends_it(tmp_path):
    """Ctrl-C pressed twice: the first ends the script, the second lands in run's own end (the
    watch stopping, the summary printed). It ended as `ampaudit: interrupted`, exit 130 - not
    killed by SIGINT as the script's own interrupt would end it (seen on 8 of 12 runs that got a
    second SIGINT 0-50 ms after the first). Here a thread interrupts the main thread again and
    again once the script raised its own."""
    (tmp_path / "s.py").write_text(
        "import _thread, threading, time, torch\n"
        "def again():\n"
        "    for _ in range(40):  # the second Ctrl-C, until the process ends\n"
        "        time.sleep(0.005)\n"
        "        _thread.interrupt_main()\n"
        "torch.nn.Linear(2, 2)(torch.ones(1, 2))\n"
        "threading.Thread(target=again, daemon=True).start()\n"
        "raise KeyboardInterrupt\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    watched = subprocess.run([sys.executable, "-m", "ampaudit", "run", "--log", "w.jsonl", "s.py"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120, env=env)
    assert watched.returncode == -2, watched.stderr
    assert "ampaudit: interrupted" not in watched.stderr


def test_the_default_log_that_cannot_be_written_leaves_the_script_to_train(cli, tmp_path, monkeypatch):
    """`ampaudit run s.py` with no --log in a folder holding another ampaudit-watch.jsonl (or
    one not writable, or an earlier run still writing it) exited 2 before the script ran, where
    `python s.py` trains: a log not asked for is watched without; one asked for is refused."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text("import torch\ntorch.nn.Linear(2, 2)(torch.ones(1, 2))\nprint('trained')\n")
    (tmp_path / "ampaudit-watch.jsonl").write_text("my notes\n")
    result = cli("run", "s.py")
    assert (result.code, result.out) == (0, "trained\n")
    assert ("ampaudit run: the log ampaudit-watch.jsonl exists and is not an ampaudit watch log: refusing to "
            "overwrite it: watching without a log (--log FILE names one)\n") in result.err
    assert "log written" not in result.err
    assert (tmp_path / "ampaudit-watch.jsonl").read_text() == "my notes\n"
    asked = cli("run", "--log", "ampaudit-watch.jsonl", "s.py")
    assert (asked.code, asked.out) == (2, "")
    assert "is not an ampaudit watch log: refusing to overwrite it" in asked.err


def test_a_folder_with_a_main_runs_as_python_runs_it(cli, tmp_path, monkeypatch):
    """`python app/` runs app/__main__.py (a zipapp's layout, unzipped); `ampaudit run app/`
    said "no such script" and exited 2."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "helper.py").write_text("WHAT = 'trained'\n")
    (tmp_path / "app" / "__main__.py").write_text(
        "import torch\nfrom helper import WHAT\ntorch.nn.Linear(2, 2)(torch.ones(1, 2))\nprint(WHAT)\n")
    plain = subprocess.run([sys.executable, "app"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (plain.returncode, plain.stdout) == (0, "trained\n"), plain.stderr
    result = cli("run", "--log", "w.jsonl", "app")
    assert (result.code, result.out) == (0, "trained\n"), result.err
    (tmp_path / "app" / "__main__.py").unlink()  # a folder python cannot run either: said in one line
    result = cli("run", "--log", "w.jsonl", "app")
    assert (result.code, result.out) == (2, "")
    assert result.err == "ampaudit: error: app is a folder without a __main__.py: name the script to run\n"


@pytest.mark.parametrize("last", ["raise ValueError('boom')", "raise KeyboardInterrupt"])
def test_a_script_s_uncaught_exception_is_printed_as_python_prints_it(tmp_path, last):
    """Its traceback from the script's own frames on, with python's file names (absolute):
    runpy's frames and run's own were printed above them, and an interrupt was one line of ours."""
    (tmp_path / "s.py").write_text(f"import torch\ndef f():\n    {last}\nprint('x', __file__)\nf()\n")
    plain, watched = _plain_and_run(tmp_path)
    assert plain.stderr.startswith("Traceback (most recent call last):\n") and "s.py" in plain.stdout
    assert (watched.returncode, watched.stdout) == (plain.returncode, plain.stdout)
    assert watched.stderr.startswith(plain.stderr), watched.stderr


def test_a_forked_child_interrupted_ends_as_under_python(tmp_path):
    """os.fork() in the script, the child ended by an uncaught KeyboardInterrupt: the parent's
    waitpid() sees it killed by SIGINT, under run as under python."""
    (tmp_path / "s.py").write_text(
        "import os, torch\n"
        "torch.nn.Linear(2, 2)(torch.ones(1, 2))\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    raise KeyboardInterrupt\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print('child', os.WIFSIGNALED(status), os.WEXITSTATUS(status) if os.WIFEXITED(status) else None)\n")
    plain, watched = _plain_and_run(tmp_path)
    assert (plain.returncode, plain.stdout) == (0, "child True None\n")
    assert (watched.returncode, watched.stdout) == (plain.returncode, plain.stdout), watched.stderr


NAMES_SCRIPT = """
import sys, __main__
def f() -> int: ...
print(sys.argv[0], __file__, __name__, __main__.__file__ == __file__, f.__annotations__["return"] is int)
"""


@pytest.mark.parametrize("typed", ["s.py", "./s.py", "app"])
def test_the_script_sees_its_names_as_under_python(tmp_path, typed):
    """sys.argv[0] as typed (a script prints or logs its command line), __file__ absolute, and
    none of run's own `from __future__` flags: under run sys.argv[0] was the absolute path
    (runpy.run_path sets it to the path it runs)."""
    (tmp_path / "app").mkdir()
    (tmp_path / "s.py").write_text(NAMES_SCRIPT)
    (tmp_path / "app" / "__main__.py").write_text(NAMES_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plain = subprocess.run([sys.executable, typed], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    watched = subprocess.run([sys.executable, "-m", "ampaudit", "run", "--log", "w.jsonl", typed], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120, env=env)
    assert plain.returncode == 0 and plain.stdout.startswith(f"{typed} {tmp_path}"), plain.stderr
    assert (watched.returncode, watched.stdout) == (0, plain.stdout), watched.stderr


RECURSION_SCRIPT = """
import sys, threading
def depth(n=0):
    try:
        return depth(n + 1)
    except RecursionError:
        return n
print(sys.getrecursionlimit(), depth())
sys.setrecursionlimit(1500)
print(sys.getrecursionlimit(), depth())
room = []
thread = threading.Thread(target=lambda: room.append(depth()))
thread.start(), thread.join()
print(room[0] >= 1495)  # python: 1495 (the thread starts on threading's frames)
for bad in (0, 1.5):
    try:
        sys.setrecursionlimit(bad)
    except (TypeError, ValueError) as e:
        print(type(e).__name__, e)
"""


@pytest.mark.parametrize("typed", ["s.py", "deep"])
def test_the_script_recurses_as_deep_as_under_python(cli, tmp_path, monkeypatch, typed):
    """run's frames (and pytest's, here) sit below the script's: a script recursing near its
    limit got 9-12 frames less and raised RecursionError where python did not. Its limit, as it
    reads and sets it, and how deep it goes are python's."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "deep").mkdir()  # not "app": another test ran one in this process
    (tmp_path / "s.py").write_text(RECURSION_SCRIPT)
    (tmp_path / "deep" / "__main__.py").write_text(RECURSION_SCRIPT)
    plain = subprocess.run([sys.executable, typed], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and plain.stdout.splitlines()[2] == "True", plain.stderr
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # python's default, as the plain run had it
    try:
        result = cli("run", "--log", "w.jsonl", typed)
        assert sys.getrecursionlimit() == 1000  # run's own limit again after the script
    finally:
        sys.setrecursionlimit(limit)
    if typed == "s.py":
        assert (result.code, result.out) == (0, plain.stdout), result.err
    else:  # a folder's __main__ runs on runpy's frames, whose depth varies by one here: never less room
        assert result.code == 0, result.err
        for ours, python in zip(result.out.splitlines(), plain.stdout.splitlines(), strict=True):
            if ours != python:
                (limit, depth), (python_limit, python_depth) = map(str.split, (ours, python))
                assert limit == python_limit and int(python_depth) <= int(depth) <= int(python_depth) + 1


def test_a_script_that_does_not_compile_is_reported_as_python_reports_it(tmp_path):
    """A SyntaxError is the script's, printed as python prints it (the file, line and caret,
    no traceback): run printed its own frames above it, compile() in run_script."""
    (tmp_path / "s.py").write_text("import torch\nx = (1,\nprint('x')\n")
    plain, watched = _plain_and_run(tmp_path)
    assert plain.returncode == 1 and "SyntaxError" in plain.stderr and "Traceback" not in plain.stderr
    assert (watched.returncode, watched.stdout) == (plain.returncode, plain.stdout)
    assert watched.stderr.startswith(plain.stderr), watched.stderr


DDP_SCRIPT = """
import torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(3, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("rank", dist.get_rank(), "trained")
dist.destroy_process_group()
"""


def test_each_rank_of_a_distributed_launch_trains_and_the_log_is_rank_0_s(tmp_path):
    """A launcher (srun, mpirun, a torchrun wrapper) runs `ampaudit run --log w.jsonl s.py` in
    every rank: rank 1 found the log held by rank 0 and exited 2 before training ('refusing a
    second writer'), and rank 0 waited for it forever. A rank other than 0 (torch's RANK)
    writes no log and says so; the log is rank 0's, as docs/watch.md says."""
    import socket

    (tmp_path / "s.py").write_text(DDP_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "ampaudit", "run", "--log", "w.jsonl", "s.py"], cwd=tmp_path,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        out = [proc.communicate(timeout=90) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], out[1][1]
    assert [o for o, _ in out] == ["rank 0 trained\n", "rank 1 trained\n"]
    assert "ampaudit run: log written to w.jsonl" in out[0][1]
    assert "ampaudit run: rank 1 of 2: the log is rank 0's: watching without one\n" in out[1][1]
    assert "log written" not in out[1][1]
    # its header names the run's 2 processes, and that the records are rank 0's own: run adds
    # no collective to the script (the header said "world": 1)
    header, steps = open_log(tmp_path / "w.jsonl", steps_only=True)
    assert (header["world"], header["rank"]) == (2, 0)
    assert [step["layers"]["(model)"]["forward"]["numel"] for step in steps] == [3 * 2, 3 * 2]  # one rank's


def test_the_folder_run_starts_in_is_not_on_the_scripts_path_unless_python_puts_it_there(tmp_path):
    """``python sub/train.py`` puts ``sub/`` first on sys.path and not the folder it starts in;
    ``python -m ampaudit run sub/train.py`` left that folder (``-m`` puts it first) on the path
    too: a module beside the shell found there (Pytorch-UNet's ``evaluate.py``, run through a
    wrapper elsewhere) imported under run and failed under python."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "helper.py").write_text("")
    (tmp_path / "sub" / "train.py").write_text(
        "import sys\nprint(sys.path[0].endswith('sub'))\n"
        "try:\n    import helper\n    print('found')\nexcept ImportError:\n    print('missing')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plain = subprocess.run([sys.executable, "sub/train.py"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=60, env=env)
    watched = subprocess.run([sys.executable, "-m", "ampaudit", "run", "--log", "w.jsonl", "sub/train.py"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert plain.stdout == "True\nmissing\n"
    assert (watched.returncode, watched.stdout) == (0, plain.stdout), watched.stderr


def test_a_log_the_script_writes_itself_is_left_to_the_script(tmp_path):
    """``--log metrics.jsonl`` naming the file the script writes its own metrics to: the watch
    kept writing at its own offset into the file the script had emptied - the script's lines
    and the watch's records mixed, with a run of NUL bytes between, neither readable. A log
    another writer emptied, filled or replaced since the watch wrote it is no longer written:
    the script's file is its own, and the summary says where the log stopped."""
    (tmp_path / "s.py").write_text(
        "import json, os, torch\nOUT = 'metrics.jsonl'\ntorch.manual_seed(0)\n"
        "m = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "with open(OUT, 'w') as f:\n"
        "    for i in range(4):\n"
        "        loss = m(torch.randn(3, 4)).pow(2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "        f.write(json.dumps({'step': i, 'loss': round(loss.item(), 6)}) + '\\n'); f.flush()\n"
        "print(open(OUT).read(), end='')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plain = subprocess.run([sys.executable, "s.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    mine = (tmp_path / "metrics.jsonl").read_bytes()
    (tmp_path / "metrics.jsonl").unlink()
    watched = subprocess.run([sys.executable, "-m", "ampaudit", "run", "--log", "metrics.jsonl", "s.py"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert (watched.returncode, watched.stdout) == (0, plain.stdout), watched.stderr
    assert (tmp_path / "metrics.jsonl").read_bytes() == mine  # the script's lines, nothing of the watch's
    assert "log written to" not in watched.stderr
    said = "by another process (the script itself?)"
    assert watched.stderr.count(said) == 2  # as it happens, and in the summary
    assert "ampaudit run: the log metrics.jsonl stops " in watched.stderr


@pytest.mark.parametrize("other", ["emptied", "appended", "replaced", "removed"])
def test_a_log_another_writer_touched_is_not_written_again(tmp_path, capsys, other):
    from ampaudit.watch.log_file import LogSink

    sink = LogSink(tmp_path / "w.jsonl")
    sink.open({"dtype": "float16"})
    sink.write({"step": 0, "layers": {}, "params": {}})
    if other == "emptied":
        (tmp_path / "w.jsonl").write_text("mine\n")
    elif other == "appended":
        with open(tmp_path / "w.jsonl", "a") as f:
            f.write("mine\n")
    elif other == "replaced":
        (tmp_path / "new").write_text("mine\n")
        os.replace(tmp_path / "new", tmp_path / "w.jsonl")
    else:
        (tmp_path / "w.jsonl").unlink()
    before = (tmp_path / "w.jsonl").read_bytes() if other != "removed" else None
    sink.write({"step": 1, "layers": {}, "params": {}})
    sink.close({"steps": 2})
    after = (tmp_path / "w.jsonl").read_bytes() if other != "removed" else None
    assert after == before and not sink.is_open
    gone = "removed or replaced" if other in ("replaced", "removed") else "written"
    assert (sink.last_step, sink.failure.split(" by ")[0]) == (0, gone)
    assert capsys.readouterr().err.count("logging stopped") == 1


def test_a_file_the_script_opens_on_a_closed_stderr_s_descriptor_gets_no_summary(tmp_path):
    """A script that closes file descriptor 2 and opens a file (it takes descriptor 2), still
    open at the script's end: the summary went to ``sys.stderr`` - into that file, 2.4 kB of
    table after the script's 21 bytes. It goes to the stream there at the start (a copy of its
    descriptor), whatever now holds the number."""
    (tmp_path / "s.py").write_text(
        "import atexit, os, torch\nm = torch.nn.Linear(4, 2)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "os.close(2)\nf = open('losses.txt', 'w')\natexit.register(f.close)\n"
        "for _ in range(3):\n"
        "    loss = m(torch.ones(3, 4)).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step()\n"
        "    f.write(f'{loss.item():.4f}\\n'); f.flush()\nprint('fd', f.fileno())\n")
    plain, watched = _plain_and_run(tmp_path)
    assert (plain.returncode, plain.stdout) == (0, "fd 2\n")
    assert (watched.returncode, watched.stdout) == (0, "fd 2\n")
    assert (tmp_path / "losses.txt").read_text().count("\n") == 3  # the script's three lines, nothing else
    assert "ampaudit watch" in watched.stderr and watched.stderr.endswith("log written to w.jsonl\n")


def test_a_script_on_stdin_is_refused_in_words_that_say_so(cli, tmp_path, monkeypatch):
    """`python -` runs the script on stdin; `ampaudit run -` said "no such script: -"."""
    monkeypatch.chdir(tmp_path)
    result = cli("run", "--log", "w.jsonl", "-")
    assert (result.code, result.out) == (2, "")
    assert result.err == ("ampaudit: error: ampaudit run takes no script on stdin ('-'): save it to a file and name "
                          "that\n")


def test_the_log_stops_before_it_takes_the_disk_the_script_needs(tmp_path, capsys, monkeypatch):
    """A log grows ~15 kB a step on nanoGPT: a long run's default log could fill the disk the
    script writes its checkpoints to (on a 3 MB tmpfs, 200 steps of a small GPT's log left no room
    for its 420 kB checkpoint). It takes at most half the space free when it opened: the file
    kept as written, said once, training untouched, the totals counting every step."""
    import torch

    import ampaudit
    from ampaudit.watch import log_file

    real = os.fstatvfs
    # 4 kB blocks, 1000 free at the log's opening: it stops at 500 free, at the fourth step's write
    free_blocks = iter([1000, 900, 700, 520, 480, 400, 300, 200, 100])

    class Disk:
        def __init__(self, free: int) -> None:
            self.f_frsize, self.f_blocks, self.f_bavail = 4096, 10_000, free

    monkeypatch.setattr(log_file.os, "fstatvfs", lambda fd: Disk(next(free_blocks)))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampaudit.watch(model, optimizer=opt, log=tmp_path / "w.jsonl") as monitor:
        for _ in range(6):
            loss = model(torch.ones(3, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    monkeypatch.setattr(log_file.os, "fstatvfs", real)
    steps = [json.loads(line).get("step") for line in (tmp_path / "w.jsonl").read_text().splitlines()[1:]]
    assert steps == [0, 1, 2]  # no more lines, no end line
    assert (monitor.sink.last_step, monitor.sink.failure) == (2, "the disk is nearly full (2 MB free)")
    said = capsys.readouterr().err
    assert said.count("ampaudit: the log") == 1 and "stopped: 2 MB free on its disk, kept for the script" in said
    assert monitor.summary()["steps"] == 6


def test_a_disk_that_reports_no_size_never_stops_the_log(tmp_path, capsys, monkeypatch):
    """A file system with no size to report - a tmpfs mounted with size=0 (unlimited), a FUSE
    file system without statfs - says 0 blocks, 0 free: the guard read that as a full disk and
    stopped the log before its first step ("stopped: 0 MB free", the header alone; seen on a real
    size=0 tmpfs). Such a disk is not guarded: every step is written."""
    import torch

    import ampaudit
    from ampaudit.watch import log_file

    class Unsized:
        f_frsize, f_blocks, f_bavail = 4096, 0, 0

    monkeypatch.setattr(log_file.os, "fstatvfs", lambda fd: Unsized())
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampaudit.watch(model, optimizer=opt, log=tmp_path / "w.jsonl") as monitor:
        for _ in range(3):
            model(torch.ones(3, 4)).pow(2).mean().backward()
            opt.step()
    lines = [json.loads(line) for line in (tmp_path / "w.jsonl").read_text().splitlines()[1:]]
    assert [r.get("step") for r in lines] == [0, 1, 2, None] and "end" in lines[-1]
    assert monitor.sink.failure is None and "ampaudit: the log" not in capsys.readouterr().err


def test_a_log_whose_header_cannot_be_written_is_not_left_behind(tmp_path):
    """A full disk at the log's opening (a full 2 MB tmpfs; here a file size limit of 0, the same
    write error) is one line, exit 2, before the script runs - and it left an empty file at the
    log's path, which `ampaudit report` then called empty. The file it created is removed."""
    code = ("import resource, sys\n"
            "from ampaudit.core.errors import UsageError\n"
            "from ampaudit.watch.log_file import create_log\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # python ignores SIGXFSZ: a write fails\n"
            "try:\n"
            "    create_log(sys.argv[1], {'dtype': 'float16'})\n"
            "except UsageError as exc:\n"
            "    print(exc)\n")
    log = tmp_path / "w.jsonl"
    done = subprocess.run([sys.executable, "-c", code, str(log)], cwd=ROOT, capture_output=True, text=True)
    assert done.stdout == f"cannot write the log {log}: File too large\n", done.stderr
    assert not log.exists()


def test_a_log_on_a_file_system_without_locks_is_written_unlocked(tmp_path, monkeypatch):
    """flock on NFS without a lock manager fails with ENOLCK: the log's lock against a second
    writer raised it, and `ampaudit run --log` on such a disk ended 'ampaudit: error: No locks
    available' before the script ran. The log is written without the lock."""
    import errno
    import fcntl

    import torch

    import ampaudit

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampaudit.watch(model, optimizer=opt, log=tmp_path / "w.jsonl"):
        for _ in range(2):
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
    lines = (tmp_path / "w.jsonl").read_text().splitlines()[1:]
    assert [json.loads(line).get("step") for line in lines] == [0, 1, None]
