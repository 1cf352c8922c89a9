"""Every output is safe against links, devices, walked files, races and crashes (issue 24):
core/outputs.py resolves an output once, before user code runs; core/files.py writes it."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from ampaudit.core.errors import UsageError
from ampaudit.core.outputs import resolve_output, write_output

DEPRECATED = "import torch\nscaler = torch.cuda.amp.GradScaler()\n"
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a link owned by another uid, mknod)")
NOBODY = 65534


def _one_line(result, code: int = 2) -> str:
    assert result.code == code, result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ampaudit: error: "), result.err
    return lines[0]


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(DEPRECATED)
    return tmp_path


# 1. an output never lands on a file the walk reads
def test_output_onto_a_walked_file_is_refused(tree, cli):
    line = _one_line(cli("check", "src", "--lint-only", "-o", "src/train.py"))
    assert line.endswith("-o src/train.py is an input of this command (src/train.py): refusing to overwrite it")
    assert (tree / "src" / "train.py").read_text() == DEPRECATED


def test_output_onto_a_hard_link_of_a_walked_file_is_refused(tree, cli):
    os.link(tree / "src" / "train.py", tree / "alias.txt")
    assert "is an input of this command" in _one_line(cli("check", "src", "--lint-only", "-o", "alias.txt"))
    assert (tree / "src" / "train.py").read_text() == DEPRECATED


# 2. devices and FIFOs are written in place, never replaced
@pytest.mark.skipif(os.geteuid() == 0, reason="as root a regression would replace the machine's /dev/null: "
                                              "test_a_device_node_stays_a_device_node uses a node of its own")
def test_dev_null_is_written_not_replaced(tree, cli):
    before = os.stat("/dev/null")
    assert cli("check", "src", "--lint-only", "-o", "/dev/null").code == 1
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


@ROOT_ONLY
def test_a_device_node_stays_a_device_node(tree, cli):
    os.mknod(tree / "n", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    assert cli("check", "src", "--lint-only", "-o", "n").code == 1
    assert stat.S_ISCHR(os.lstat(tree / "n").st_mode)
    assert [p.name for p in tree.iterdir() if p.name.startswith(".n.")] == []  # no temporary file left


def test_a_fifo_without_a_reader_is_refused_at_once(tree, cli):
    os.mkfifo(tree / "pipe")
    start = time.monotonic()
    line = _one_line(cli("check", "src", "--lint-only", "-o", "pipe"))
    assert line.endswith("-o pipe is a FIFO that no process reads: nothing written")
    assert time.monotonic() - start < 5 and stat.S_ISFIFO(os.lstat(tree / "pipe").st_mode)


def test_a_fifo_with_a_reader_gets_the_whole_report(tree, cli):
    os.mkfifo(tree / "pipe")
    reader = os.open(tree / "pipe", os.O_RDONLY | os.O_NONBLOCK)  # open before ampaudit: no race
    try:
        result = cli("check", "src", "--lint-only", "--format", "json", "-o", "pipe")
        got = os.read(reader, 1 << 16)  # the report is far below a pipe's buffer
    finally:
        os.close(reader)
    assert result.code == 1 and b'"rule": "AMP401"' in got
    assert stat.S_ISFIFO(os.lstat(tree / "pipe").st_mode)


def test_a_socket_is_refused(tree, cli):
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tree / "sock"))
        assert _one_line(cli("check", "src", "--lint-only", "-o", "sock")).endswith("-o sock is a socket: name a "
                                                                                     "regular file")
    finally:
        sock.close()


# 3. links: followed only when the user (or root) owns them and no one else can swap them
def test_own_link_in_own_folder_is_written_through(tree, cli):
    (tree / "real.txt").write_text("old")
    (tree / "report.txt").symlink_to("real.txt")
    assert cli("check", "src", "--lint-only", "-o", "report.txt").code == 1
    assert (tree / "report.txt").is_symlink() and "AMP401" in (tree / "real.txt").read_text()


def test_link_in_a_folder_others_can_write_is_refused(tree, cli):
    shared = tree / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # world-writable, not sticky: anyone may swap the link
    (tree / "victim").write_text("secret")
    (shared / "report.txt").symlink_to(tree / "victim")
    line = _one_line(cli("check", "src", "--lint-only", "-o", "shared/report.txt"))
    assert line.endswith("-o shared/report.txt is a symbolic link in a folder others can write: not followed")
    assert (tree / "victim").read_text() == "secret"


@ROOT_ONLY
@pytest.mark.parametrize("flag", ["-o", "--log"])
def test_a_planted_link_owned_by_another_user_is_refused(tree, cli, flag):
    shared = tree / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (tree / "victim").write_text("secret")
    (shared / "report.txt").symlink_to(tree / "victim")
    os.lchown(shared / "report.txt", NOBODY, NOBODY)
    (tree / "t.py").write_text("x = 1\n")
    argv = ["check", "src", "--lint-only", "-o"] if flag == "-o" else ["run", "--log"]
    argv += ["shared/report.txt"] + (["t.py"] if flag == "--log" else [])
    line = _one_line(cli(*argv))
    assert line.endswith(f"{flag} shared/report.txt is a symbolic link owned by another user (uid {NOBODY}): "
                         "not followed (remove it, or write elsewhere)")
    assert (tree / "victim").read_text() == "secret"


@ROOT_ONLY
def test_a_dangling_planted_link_is_not_created_by_run_log(tree, cli):
    (tree / "log.jsonl").symlink_to(tree / "created.jsonl")
    os.lchown(tree / "log.jsonl", NOBODY, NOBODY)
    (tree / "t.py").write_text("x = 1\n")
    assert "owned by another user" in _one_line(cli("run", "--log", "log.jsonl", "t.py"))
    assert not (tree / "created.jsonl").exists()


@ROOT_ONLY
def test_as_an_ordinary_user_links_and_devices_hold():
    """The same rules run as uid 65534: /dev/null written, a root link to /etc/passwd in a
    sticky folder refused, the user's own files written."""
    tmp_path = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's own folders are root's alone
    tmp_path.chmod(0o1777)
    (tmp_path / "train.py").write_text(DEPRECATED)
    (tmp_path / "planted").symlink_to("/etc/passwd")
    script = ("import sys; from ampaudit.cli.main import main\n"
              "codes = [main(['check', 'train.py', '--lint-only', '-o', o]) for o in sys.argv[1:]]\n"
              "print(codes)\n")
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable]
    probe = subprocess.run([*drop, "-c", "import ampaudit"], cwd=tmp_path, capture_output=True, timeout=60)
    if probe.returncode != 0:  # the interpreter or the install lies in a folder only root may read
        shutil.rmtree(tmp_path)
        pytest.skip(f"uid {NOBODY} cannot import ampaudit here")
    before = Path("/etc/passwd").read_bytes()
    done = subprocess.run([*drop, "-c", script, "/dev/null", "planted", "mine.txt"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[1, 2, 1]", done.stderr
    assert "planted is a symbolic link in a folder others can write" in done.stderr
    assert Path("/etc/passwd").read_bytes() == before and (tmp_path / "mine.txt").stat().st_uid == NOBODY
    shutil.rmtree(tmp_path)


# 4. pre-commit passes file names that look like options
def test_a_file_named_like_an_option_is_a_path(tree, cli):
    (tree / "-ofoo.py").write_text(DEPRECATED)
    (tree / "foo.py").write_text("keep\n")
    result = cli("check", "--lint-only", "src/train.py", "-ofoo.py", "--format", "json")
    assert result.code == 1 and (tree / "foo.py").read_text() == "keep\n"
    assert sorted({f["file"] for f in result.json()["findings"]}) == ["-ofoo.py", "src/train.py"]


def test_the_pre_commit_hook_passes_files_after_a_double_dash():
    hook = (Path(__file__).parents[1] / ".pre-commit-hooks.yaml").read_text()
    assert '    args: ["--"]' in hook and "entry: ampaudit check --lint-only\n" in hook


# 6. a plot is written whole or not at all
def test_a_plot_cut_by_a_file_size_limit_keeps_the_earlier_plot(tmp_path):
    pytest.importorskip("matplotlib")
    log = Path(__file__).parents[1] / "fixtures" / "watch" / "AMP605_invalid.jsonl"
    plot = tmp_path / "plot.png"
    plot.write_bytes(b"an earlier plot")

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))

    done = subprocess.run([sys.executable, "-m", "ampaudit", "report", str(log), "--plot", str(plot)],
                          capture_output=True, text=True, preexec_fn=limit, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"ampaudit: error: cannot write --plot {plot}: File too large"
    assert plot.read_bytes() == b"an earlier plot"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]


# 7. outputs are resolved before the model's code runs
def test_a_model_that_changes_folder_does_not_move_the_output(tree, cli):
    elsewhere = tree / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "out.txt").write_text("keep")
    (tree / "m.py").write_text(f"import os\nimport torch\n\n\ndef get_model():\n    os.chdir({str(elsewhere)!r})\n"
                               "    return torch.nn.Linear(4, 4)\n")
    try:
        result = cli("check", "m.py", "--input-shape", "2,4", "-o", "out.txt")
    finally:
        os.chdir(tree)
    assert result.code in (0, 1), result.err
    assert (elsewhere / "out.txt").read_text() == "keep" and "ampaudit check" in (tree / "out.txt").read_text()


def test_outputs_resolve_to_absolute_paths(tree):
    out = resolve_output("r.txt", "-o")
    os.chdir("src")
    write_output(out, "text")
    assert (tree / "r.txt").read_text() == "text" and not (tree / "src" / "r.txt").exists()


# 8. one writer per watch log
def test_a_second_watch_on_a_log_being_written_is_refused(tree):
    torch = pytest.importorskip("torch")
    import ampaudit
    from ampaudit.watch.log_file import open_log

    net = torch.nn.Linear(2, 2)
    with ampaudit.watch(net, log="run.jsonl"):
        for _ in range(3):
            net(torch.ones(1, 2)).sum().backward()
        with pytest.raises(UsageError, match="being written by another watch: refusing a second writer"), \
                ampaudit.watch(torch.nn.Linear(2, 2), log="run.jsonl"):
            pass
        net(torch.ones(1, 2)).sum().backward()
    assert b"\0" not in (tree / "run.jsonl").read_bytes()
    header, records = open_log(tree / "run.jsonl")
    assert header["ampaudit_watch"] == 3 and len(list(records)) >= 1


def test_a_finished_log_may_be_written_again(tree):
    torch = pytest.importorskip("torch")
    import ampaudit

    for _ in range(2):
        net = torch.nn.Linear(2, 2)
        with ampaudit.watch(net, log="run.jsonl"):
            net(torch.ones(1, 2)).sum().backward()


# 10. ownership and modes
@ROOT_ONLY
def test_fix_as_root_keeps_the_files_owner_and_mode(tree, cli):
    script = tree / "src" / "train.py"
    os.chown(script, NOBODY, NOBODY)
    script.chmod(0o640)
    assert cli("check", "src", "--lint-only", "--fix").code == 0
    info = script.stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (NOBODY, NOBODY, 0o640)
    assert "torch.amp.GradScaler" in script.read_text()


def test_a_file_no_one_may_write_is_refused_even_for_root(tree, cli):
    script = tree / "src" / "train.py"
    script.chmod(0o444)
    assert _one_line(cli("check", "src", "--lint-only", "--fix")).endswith(
        "src/train.py is read-only: not rewritten (make it writable to allow it)")
    assert script.read_text() == DEPRECATED


def test_a_read_only_file_in_a_folder_does_not_stop_the_others_fixes(tree, cli):
    # --fix on a folder once stopped at the first file it could not write: the files before it
    # rewritten without a word, the ones after it left as they were
    for name in ("a.py", "z.py"):
        (tree / "src" / name).write_text(DEPRECATED)
    (tree / "src" / "train.py").chmod(0o444)
    line = _one_line(cli("check", "src", "--lint-only", "--fix"))
    assert line == ("ampaudit: error: src/train.py is read-only: not rewritten (make it writable to allow it) "
                    "(2 other file(s) fixed: src/a.py, src/z.py)")
    assert (tree / "src" / "train.py").read_text() == DEPRECATED
    assert all("torch.amp.GradScaler" in (tree / "src" / n).read_text() for n in ("a.py", "z.py"))


# 11. reads that would never end, and one bad file in a walk
@pytest.mark.parametrize(("argv", "expected"), [
    (["check", "pipe"], "pipe is not a regular file or a folder (a FIFO or a device): not read"),
    (["check", "/dev/zero"], "/dev/zero is not a regular file or a folder (a FIFO or a device): not read"),
    (["check", "src", "--lint-only", "--policy", "pipe"], "--policy pipe is not a regular file"),
    (["report", "pipe"], "the log pipe is not a regular file (a FIFO or a device): not read"),
    (["report", "/dev/zero"], "the log /dev/zero is not a regular file"),
])
def test_fifos_and_endless_devices_are_not_read(tree, cli, argv, expected):
    os.mkfifo(tree / "pipe")
    start = time.monotonic()
    assert expected in _one_line(cli(*argv))
    assert time.monotonic() - start < 5


def test_a_file_python_cannot_decode_does_not_stop_the_walk(tree, cli):
    (tree / "src" / "odd.py").write_text("# -*- coding: undefined -*-\nx = 1\n")
    result = cli("check", "src", "--lint-only", "--format", "json")
    rules = sorted((f["file"], f["rule"]) for f in result.json()["findings"])
    assert rules == [("src/odd.py", "AMP004"), ("src/train.py", "AMP401")]


def test_fix_waits_a_bounded_time_for_another_processs_lock(tree, cli, monkeypatch):
    import fcntl

    from ampaudit.core import files

    monkeypatch.setattr(files, "LOCK_WAIT", 0.3)
    script = tree / "src" / "train.py"
    with open(script, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        start = time.monotonic()
        line = _one_line(cli("check", "src", "--lint-only", "--fix"))
        assert 0.3 <= time.monotonic() - start < 5
    assert line.endswith("is locked by another process (another --fix?) for over 0.3 s: not rewritten")
    assert script.read_text() == DEPRECATED


def test_fix_through_an_alias_link_inside_the_tree_fixes_once(tree, cli):
    (tree / "src" / "alias.py").symlink_to("train.py")
    result = cli("check", "src", "--lint-only", "--fix")
    assert result.code == 0 and result.err.strip() == "Fixed 1 finding in 1 file(s)."
    assert 'torch.amp.GradScaler("cuda")' in (tree / "src" / "train.py").read_text()


# the atomic write itself
def test_a_write_killed_at_the_rename_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "report.txt"
    target.write_text("old")
    script = ("import os, sys\nfrom pathlib import Path\nfrom ampaudit.core.outputs import resolve_output, "
              "write_output\nos.replace = lambda *a, **k: os._exit(9)\n"
              f"write_output(resolve_output({str(target)!r}, '-o'), 'new' * 1000)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert done.returncode == 9 and target.read_text() == "old"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "report.txt"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".report.txt.")  # a kill -9 cannot clean up


def test_sigterm_during_a_write_removes_the_temporary_file(tmp_path):
    target = tmp_path / "report.txt"
    script = ("import os, signal, sys\nfrom ampaudit.cli import main as m\nfrom ampaudit.core import files\n"
              "real = os.replace\n"
              "def slow(*a, **k):\n    os.kill(os.getpid(), signal.SIGTERM)\n    real(*a, **k)\n"
              "files.os.replace = slow\n"
              f"sys.exit(m.main(['check', {str(tmp_path / 't.py')!r}, '--lint-only', '-o', {str(target)!r}]))\n")
    (tmp_path / "t.py").write_text(DEPRECATED)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143 and done.stderr.strip() == "ampaudit: terminated"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.py"]


def test_concurrent_writers_leave_one_whole_output(tmp_path):
    texts = [str(i) * 200_000 for i in range(6)]
    threads = [threading.Thread(target=lambda t: write_output(resolve_output(tmp_path / "r.txt", "-o"), t),
                                args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (tmp_path / "r.txt").read_text() in texts
    assert [p.name for p in tmp_path.iterdir()] == ["r.txt"]


# found by trying to break the rules above (issue 24's second pass)
def test_convert_output_is_resolved_before_the_model_changes_folder(tree, cli):
    pytest.importorskip("safetensors")
    (tree / "else").mkdir()
    (tree / "mc.py").write_text(f"import os\nimport torch\n\n\ndef get_model():\n    os.chdir({str(tree / 'else')!r})\n"
                                "    return torch.nn.Sequential(torch.nn.Linear(4, 4))\n")
    try:
        result = cli("convert", "mc.py", "-o", "out", "--input-shape", "2,4", "--no-verify", "--train-steps", "0")
    finally:
        os.chdir(tree)
    assert result.code == 0, result.err
    assert (tree / "out" / "plan.json").is_file() and not (tree / "else" / "out").exists()


@ROOT_ONLY
def test_convert_output_through_another_users_link_is_refused(tree, cli):
    (tree / "victim").mkdir()
    (tree / "planted").symlink_to(tree / "victim")
    os.lchown(tree / "planted", NOBODY, NOBODY)
    (tree / "m.py").write_text("import torch\n\n\ndef get_model():\n    return torch.nn.Linear(4, 4)\n")
    line = _one_line(cli("convert", "m.py", "-o", "planted/sub", "--input-shape", "2,4", "--no-verify",
                         "--train-steps", "0"))
    assert "planted is a symbolic link owned by another user" in line and list((tree / "victim").iterdir()) == []


@ROOT_ONLY
def test_proc_self_cwd_does_not_skip_the_link_checks(tree, cli):
    (tree / "victim").mkdir()
    (tree / "planted").symlink_to(tree / "victim")
    os.lchown(tree / "planted", NOBODY, NOBODY)
    line = _one_line(cli("check", "src", "--lint-only", "-o", "/proc/self/cwd/planted/x.txt"))
    assert "is a symbolic link owned by another user" in line and list((tree / "victim").iterdir()) == []


@ROOT_ONLY
def test_fix_does_not_write_through_another_users_link(tree, cli):
    (tree / "victim.py").write_text(DEPRECATED)
    (tree / "planted.py").symlink_to(tree / "victim.py")
    os.lchown(tree / "planted.py", NOBODY, NOBODY)
    line = _one_line(cli("check", "planted.py", "--lint-only", "--fix"))
    assert "--fix planted.py is a symbolic link owned by another user" in line
    assert (tree / "victim.py").read_text() == DEPRECATED


def test_a_folder_swapped_for_a_link_after_the_check_is_not_written_through(tree):
    (tree / "out").mkdir()
    (tree / "victim").mkdir()
    out = resolve_output("out/report.txt", "-o")
    os.rename(tree / "out", tree / "moved")  # the checked folder goes; a link to another takes its name
    (tree / "out").symlink_to(tree / "victim")
    write_output(out, "report")
    assert list((tree / "victim").iterdir()) == [] and (tree / "moved" / "report.txt").read_text() == "report"


def test_dev_stdout_is_the_processs_own_stdout_even_into_an_appended_file(tmp_path):
    (tmp_path / "t.py").write_text(DEPRECATED)
    log = tmp_path / "app.txt"
    log.write_text("earlier line\n")
    with open(log, "a") as append:
        done = subprocess.run([sys.executable, "-m", "ampaudit", "check", "t.py", "--lint-only", "--format", "json",
                               "-o", "/dev/stdout"], cwd=tmp_path, stdout=append, stderr=subprocess.PIPE, text=True,
                              timeout=60)
    assert done.returncode == 1, done.stderr
    head, _, rest = log.read_text().partition("\n")
    assert head == "earlier line" and json.loads(rest)["findings"][0]["rule"] == "AMP401"


def test_run_log_to_dev_stdout(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "train.py").write_text("import torch\nm = torch.nn.Linear(2, 2)\n"
                                       "m(torch.ones(1, 2)).sum().backward()\n")
    done = subprocess.run([sys.executable, "-m", "ampaudit", "run", "--log", "/dev/stdout", "train.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[0])["ampaudit_watch"] == 3


def test_a_read_only_earlier_log_is_not_rewritten(tree, cli):
    torch = pytest.importorskip("torch")
    import ampaudit

    net = torch.nn.Linear(2, 2)
    with ampaudit.watch(net, log="run.jsonl"):
        net(torch.ones(1, 2)).sum().backward()
    before = (tree / "run.jsonl").read_bytes()
    (tree / "run.jsonl").chmod(0o444)
    with pytest.raises(UsageError, match=r"the log run\.jsonl is read-only: not rewritten"), \
            ampaudit.watch(net, log="run.jsonl"):
        pass
    assert (tree / "run.jsonl").read_bytes() == before


@pytest.mark.parametrize("argv", [
    ["convert", "pipe.py", "-o", "out"], ["run", "pipe.py"],
])
def test_a_fifo_model_or_script_is_refused(tree, cli, argv):
    os.mkfifo(tree / "pipe.py")
    assert "pipe.py is not a regular file (a FIFO or a device): not read" in _one_line(cli(*argv))


@pytest.mark.parametrize("argv", [
    ["convert", "", "-o", "out"], ["report", ""], ["run", ""], ["check", "src", "--policy", ""],
])
def test_an_empty_path_is_refused_by_every_command(tree, cli, argv):
    try:
        result = cli(*argv)
    except SystemExit as exc:  # argparse's own usage error: one line, exit 2
        assert exc.code == 2
        return
    assert "empty" in _one_line(result)


# the third pass
@pytest.mark.parametrize("argv", [
    ["convert", "m.py", "-o", "nx1/nx2/out", "--input-shape", "2,4", "--no-verify", "--train-steps", "0"],
])
def test_a_folder_output_with_missing_parents_is_created(tree, cli, argv):
    pytest.importorskip("safetensors")
    (tree / "m.py").write_text("import torch\n\n\ndef get_model():\n    return torch.nn.Linear(4, 4)\n")
    assert cli(*argv).code == 0 and (tree / "nx1" / "nx2" / "out" / "plan.json").is_file()


def test_a_fifo_swapped_for_a_link_after_the_check_is_not_written_through(tree):
    os.mkfifo(tree / "pipe")
    (tree / "secret").write_text("secret")
    out = resolve_output("pipe", "-o")
    os.unlink(tree / "pipe")
    (tree / "pipe").symlink_to(tree / "secret")
    with pytest.raises(UsageError, match="cannot write -o pipe: Too many levels of symbolic links"):
        write_output(out, "report")
    assert (tree / "secret").read_text() == "secret"


def test_fix_on_a_file_swapped_for_a_fifo_does_not_block(tree):
    from ampaudit.core.files import locked

    os.mkfifo(tree / "pipe.py")
    start = time.monotonic()
    with pytest.raises(UsageError, match="is no longer a regular file"), locked(tree / "pipe.py"):
        pass
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(("policy", "expected"), [
    ("pipe.toml", "policy file pipe.toml is not a regular file (a FIFO or a device): not read"),
    ("/dev/zero", "policy file /dev/zero is not a regular file"),
    ("", "empty"),
])
def test_ops_policy_refuses_what_check_refuses(tree, cli, policy, expected):
    os.mkfifo(tree / "pipe.toml")
    try:
        result = cli("ops", "--policy", policy)
    except SystemExit as exc:  # argparse: an empty path
        assert exc.code == 2 and expected == "empty"
        return
    assert expected in _one_line(result)


def test_an_export_folder_swapped_for_a_link_during_the_conversion_is_refused(tree, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    import ampaudit
    from ampaudit.convert import export as export_module

    (tree / "out").mkdir()
    (tree / "victim").mkdir()
    real_stage = export_module.stage

    def stage_then_swap(*args, **kwargs):
        names = real_stage(*args, **kwargs)
        os.rename(tree / "out", tree / "out.old")  # another user swaps the checked folder for a link
        (tree / "out").symlink_to(tree / "victim")
        return names

    monkeypatch.setattr(export_module, "stage", stage_then_swap)
    model = ampaudit.convert(torch.nn.Linear(4, 4), example_inputs=(torch.randn(2, 4),), verify=False)
    with pytest.raises(UsageError, match="a folder on its path was replaced"):
        export_module.export(model, tree / "out", force=True)
    assert list((tree / "victim").iterdir()) == []
    assert [p.name for p in tree.iterdir() if ".ampaudit-" in p.name] == []
