"""A property over random trees (issue 24): after any sequence of {create, link, hard link,
chmod, mkfifo, link owned by another user, concurrent writer} and any ampaudit command, no file
outside the command's declared outputs changed (content, mode, owner, type), and every declared
output is either the old file or the whole new one."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import stat
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ampaudit.cli.main import main
from ampaudit.core.outputs import resolve_output, write_output

DEPRECATED = "import torch\nscaler = torch.cuda.amp.GradScaler()\n"
CONTENTS = (DEPRECATED, "x = 1\n", "def f(:\n", "# -*- coding: undefined -*-\n")
NAMES = ("a.py", "b.py", "out.txt", "sub/c.py", "sub/out.txt", "shared/out.txt", "shared/d.py")
TARGETS = (*NAMES, "../victim.txt", "/proc/self/fd/1", "missing.txt", "sub")
NOBODY = 65534
WRITER_TEXTS = tuple(json.dumps({"writer": i}) for i in range(3))


def _scaled(ci_examples: int) -> int:
    return max(1, ci_examples * settings.default.max_examples // 100)


operation = st.one_of(
    st.tuples(st.just("create"), st.sampled_from(NAMES), st.sampled_from(CONTENTS)),
    st.tuples(st.just("link"), st.sampled_from(NAMES), st.sampled_from(TARGETS)),
    st.tuples(st.just("hardlink"), st.sampled_from(NAMES), st.sampled_from((*NAMES, "../victim.txt"))),
    st.tuples(st.just("chmod"), st.sampled_from(NAMES), st.sampled_from((0o444, 0o600, 0o640))),
    st.tuples(st.just("mkfifo"), st.sampled_from(NAMES), st.just(None)),
    st.tuples(st.just("share"), st.just("shared"), st.sampled_from((0o777, 0o1777, 0o755))),
    st.tuples(st.just("plant"), st.sampled_from(NAMES), st.sampled_from(TARGETS)),
)
command = st.one_of(
    st.tuples(st.just("report"), st.sampled_from(("tree", "tree/a.py", "tree/sub")), st.sampled_from(NAMES)),
    st.tuples(st.just("fix"), st.sampled_from(("tree", "tree/a.py", "tree/sub")), st.just(None)),
)


def _apply(root: Path, op: tuple) -> None:
    kind, name, arg = op
    path = root / "tree" / name
    with contextlib.suppress(OSError):
        if kind == "create":  # O_NONBLOCK: a FIFO at the name (or behind a link) must not block the test
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK)
            with open(fd, "w") as fh:
                fh.write(arg)
        elif kind in ("link", "plant"):
            path.symlink_to(arg)
            if kind == "plant" and os.geteuid() == 0:
                os.lchown(path, NOBODY, NOBODY)  # another user's link
        elif kind == "hardlink":
            os.link(root / "tree" / arg, path)
        elif kind == "chmod":
            path.chmod(arg)
        elif kind == "mkfifo":
            os.mkfifo(path)
        elif kind == "share":
            path.chmod(arg)


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (links not followed): type, mode, owner and content."""
    seen = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            content = None
            if stat.S_ISLNK(info.st_mode):
                content = os.readlink(path)
            elif stat.S_ISREG(info.st_mode):
                content = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            seen[os.path.relpath(path, root)] = (stat.S_IFMT(info.st_mode), stat.S_IMODE(info.st_mode),
                                                 info.st_uid, info.st_gid, content)
    return seen


def _trusted(path: Path) -> Path | None:
    """docs/files.md's link rule, written again as the oracle: ``path`` with its links followed,
    or None when one of them may not be (owned by another user; in a folder others can write,
    unless it is the user's own in a sticky one)."""
    for _ in range(40):
        try:
            info = os.lstat(path)
        except OSError:
            return path
        if not stat.S_ISLNK(info.st_mode):
            parent = _trusted(path.parent) if path.parent != path else path
            return None if parent is None else parent / path.name
        folder = os.stat(path.parent).st_mode
        shared = folder & stat.S_IWOTH and not (folder & stat.S_ISVTX and info.st_uid == os.geteuid())
        if info.st_uid not in (os.geteuid(), 0) or shared:
            return None
        path = Path(os.path.normpath(path.parent / os.readlink(path)))
    return None


def _declared(root: Path, kind: str, target: str, out: str | None) -> set[str]:
    """The files the command may change, as paths under ``root``: the output (or the target of a
    link the rule lets it follow), or the files --fix may rewrite."""
    base = root / target
    walked = [Path(f, n) for f, _, names in os.walk(base) for n in names if n.endswith(".py")]
    read = [base] if base.is_file() else walked
    if kind == "report":
        output = _trusted(Path(os.path.abspath(root / "tree" / out)))
        if output is None or any(_same(output, f) for f in read):  # an input is never an output
            return set()
        return {os.path.relpath(output, root)}
    followed = [_trusted(Path(os.path.abspath(f))) for f in read]
    return {os.path.relpath(f, root) for f in followed if f is not None}


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang


@pytest.mark.skipif(os.geteuid() == 0 and not hasattr(os, "lchown"), reason="no lchown")
@settings(max_examples=_scaled(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(operation, max_size=10), cmd=command, writer=st.booleans())
def test_only_declared_outputs_change_and_each_is_old_or_whole(ops, cmd, writer):
    kind, target, out = cmd
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "tree" / "sub").mkdir(parents=True)
        (root / "tree" / "shared").mkdir()
        (root / "victim.txt").write_text("secret\n")
        (root / "tree" / "a.py").write_text(DEPRECATED)
        for op in ops:
            _apply(root, op)
        before = _snapshot(root)
        declared = _declared(root, kind, target, out)
        argv = ["check", str(root / target), "--lint-only", "--format", "json"]
        argv += ["-o", str(root / "tree" / out)] if kind == "report" else ["--fix"]
        stop = threading.Event()
        race = None
        if writer and kind == "report" and declared:  # another writer replaces the output, whole, meanwhile
            def write_whole():
                for text in WRITER_TEXTS:
                    if stop.is_set():
                        return
                    with contextlib.suppress(Exception):  # a writer that follows the same rules
                        write_output(resolve_output(root / "tree" / out, "-o"), text)
            race = threading.Thread(target=write_whole)
            race.start()
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(30)
        cwd = os.getcwd()
        try:
            os.chdir(root)
            with contextlib.redirect_stdout(open(os.devnull, "w")), \
                    contextlib.redirect_stderr(open(os.devnull, "w")):
                code = main(argv)
        except _Hang:
            pytest.fail(f"{argv} did not end in 30 s after {ops}")
        finally:
            os.chdir(cwd)
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
            stop.set()
            if race is not None:
                race.join()
        assert code in (0, 1, 2)
        after = _snapshot(root)
        changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
        undeclared = changed - declared
        assert not undeclared, (argv, ops, {p: (before.get(p), after.get(p)) for p in undeclared})
        for path in changed:
            new, was = after.get(path), before.get(path)
            assert new is not None and new[0] == stat.S_IFREG, (path, argv, ops)
            if was is not None:  # replaced: mode and owner kept
                assert new[1:4] == was[1:4], (path, argv, ops)
            text = (root / path).read_text()
            if kind == "report":
                assert text in WRITER_TEXTS or json.loads(text)["tool"] == "ampaudit", (path, argv, ops)
            else:
                compile(text, path, "exec")
                assert "torch.amp.GradScaler" in text, (path, argv, ops)
