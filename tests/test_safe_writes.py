"""ampaudit never destroys a user's file (issue 12, data-loss items 1, 2, 4, 5): fixes are
compare-and-swap under a lock, links are written through, read-only files are refused, new
files get the umask's mode, and no output may land on an input."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from ampaudit.core.errors import UsageError
from ampaudit.core.files import write_atomic

DEPRECATED = "import torch\n\nscaler = torch.cuda.amp.GradScaler()\n"
FIXED = 'import torch\n\nscaler = torch.amp.GradScaler("cuda")\n'
NO_VERIFY = ("--no-verify", "--train-steps", "0")  # what an export's files are, not how well it converts


def test_a_file_changed_between_check_and_fix_is_not_written(tmp_path, monkeypatch):
    from ampaudit.check import fix
    from ampaudit.check.lint_file import lint_file

    script = tmp_path / "train.py"
    script.write_text(DEPRECATED)
    findings = lint_file(script)
    edited = "# the user saved a new version\n" + DEPRECATED
    script.write_text(edited)
    with pytest.raises(UsageError, match="changed since it was checked: nothing written"):
        fix.fix_files(findings, unsafe=False, write=True)
    assert script.read_text() == edited


def test_compare_and_swap_refuses_a_change_made_during_the_write(tmp_path):
    target = tmp_path / "train.py"
    target.write_text("a = 1\n")
    target.write_text("a = 2\n")  # someone else wrote after we read "a = 1"
    with pytest.raises(UsageError, match="changed since ampaudit read it"):
        write_atomic(target, "a = 3\n", expected="a = 1\n")
    assert target.read_text() == "a = 2\n"
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]  # no temporary file left


def test_concurrent_fixes_leave_valid_python(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(DEPRECATED * 1)
    run = [sys.executable, "-m", "ampaudit", "check", str(script), "--lint-only", "--fix"]
    procs = [subprocess.Popen(run, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [p.communicate(timeout=120) for p in procs]
    assert script.read_text() == FIXED  # fixed exactly once, never garbled
    compile(script.read_text(), str(script), "exec")
    for (_out, err), proc in zip(results, procs, strict=True):
        assert proc.returncode in (0, 2), err
        assert "Traceback" not in err


def test_fix_through_a_symlink_fixes_the_target_and_keeps_the_link(tmp_path, cli):
    real = tmp_path / "real.py"
    real.write_text(DEPRECATED)
    link = tmp_path / "link.py"
    link.symlink_to(real)
    assert cli("check", str(link), "--lint-only", "--fix").code == 0
    assert link.is_symlink() and real.read_text() == FIXED


def test_fix_refuses_a_file_with_several_hard_links_and_fixes_the_others(tmp_path, cli):
    # a rename replaced a.py alone: hard.py kept the old text, the link was split, nothing said
    (tmp_path / "a.py").write_text(DEPRECATED)
    os.link(tmp_path / "a.py", tmp_path / "hard.py")
    (tmp_path / "other.py").write_text(DEPRECATED)
    inode = (tmp_path / "a.py").stat().st_ino
    result = cli("check", str(tmp_path), "--lint-only", "--fix")
    assert result.code == 2 and result.out == "" and result.err.count("\n") == 1, result.err
    assert "a.py has 2 hard links: a new file renamed over this name would leave the other 1 name with the old " \
           "text; not rewritten (apply what --diff shows in an editor, or remove the other names)" in result.err
    assert result.err.rstrip().endswith(f"(1 other file(s) fixed: {tmp_path / 'other.py'})")
    assert (tmp_path / "other.py").read_text() == FIXED
    for name in ("a.py", "hard.py"):  # still one file, as it was
        assert (tmp_path / name).read_text() == DEPRECATED and (tmp_path / name).stat().st_ino == inode
    assert (tmp_path / "a.py").stat().st_nlink == 2
    diff = cli("check", str(tmp_path / "hard.py"), "--lint-only", "--diff")
    assert diff.code == 1 and 'torch.amp.GradScaler("cuda")' in diff.out  # what the message points to


def test_read_only_files_are_refused(tmp_path, cli):
    script = tmp_path / "train.py"
    script.write_text(DEPRECATED)
    script.chmod(0o444)
    if os.access(script, os.W_OK):
        pytest.skip("running as a user who can write read-only files (root)")
    result = cli("check", str(script), "--lint-only", "--fix")
    assert result.code == 2 and "read-only: not rewritten" in result.err
    assert script.read_text() == DEPRECATED


def test_read_only_check_uses_access_not_the_mode_bits(tmp_path, monkeypatch):
    target = tmp_path / "f.py"
    target.write_text("x = 1\n")
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False)
    with pytest.raises(UsageError, match="read-only"):
        write_atomic(target, "x = 2\n")
    assert target.read_text() == "x = 1\n"


def test_new_files_get_the_umask_mode_and_rewrites_keep_theirs(tmp_path):
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "report.json", "{}\n")
        assert stat.S_IMODE((tmp_path / "report.json").stat().st_mode) == 0o644
        script = tmp_path / "run.py"
        script.write_text("x = 1\n")
        script.chmod(0o750)
        write_atomic(script, "x = 2\n")
        assert stat.S_IMODE(script.stat().st_mode) == 0o750
    finally:
        os.umask(old)


@pytest.mark.parametrize("argv", [
    ("check", "{script}", "--lint-only", "-o", "{script}"),
    ("check", "{script}", "--lint-only", "--format", "json", "-o", "{link}"),
    ("run", "--log", "{script}", "{script}"),
])
def test_no_output_lands_on_an_input(tmp_path, cli, argv):
    script = tmp_path / "train.py"
    script.write_text("x = 1\n")
    (tmp_path / "link.py").symlink_to(script)
    result = cli(*(a.format(script=script, link=tmp_path / "link.py") for a in argv))
    assert result.code == 2 and "is an input of this command" in result.err
    assert script.read_text() == "x = 1\n"


def test_folder_walk_does_not_follow_links_out_of_the_tree(tmp_path, cli):
    outside = tmp_path / "outside.py"
    outside.write_text(DEPRECATED)
    tree = tmp_path / "project"
    tree.mkdir()
    (tree / "inside.py").write_text(DEPRECATED)
    (tree / "escape.py").symlink_to(outside)
    (tree / "alias.py").symlink_to(tree / "inside.py")  # a link inside the tree: the file, linted once
    result = cli("check", str(tree), "--lint-only", "--format", "json", "--fail-on", "never")
    import json

    doc = json.loads(result.out)
    assert [os.path.basename(f["file"]) for f in doc["findings"]] == ["inside.py"]
    assert any("skipped 1 link to files outside the folder" in n for n in doc["target"]["notes"])


def test_fix_never_writes_an_excluded_file_through_a_link(tmp_path, cli):
    # `--exclude vendor --fix .` rewrote vendor/a.py through link.py -> vendor/a.py: a link is
    # written through, and the exclusion was matched against the link's own name only
    import json

    for folder in ("vendor", "build", "gen"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.py").write_text(DEPRECATED)
    (tmp_path / "link.py").symlink_to("vendor/a.py")  # an excluded folder
    (tmp_path / "built.py").symlink_to("build/a.py")  # a folder the walk always skips
    (tmp_path / "gen" / "b_pb2.py").write_text(DEPRECATED)
    (tmp_path / "gen" / "alias.py").symlink_to("b_pb2.py")  # an excluded file name
    (tmp_path / "mine.py").write_text(DEPRECATED)
    result = cli("check", str(tmp_path), "--lint-only", "--exclude", "vendor", "--exclude", "*_pb2.py", "--fix",
                 "--format", "json")
    assert result.code == 0, result.err
    assert (tmp_path / "mine.py").read_text() == FIXED and (tmp_path / "gen" / "a.py").read_text() == FIXED
    for untouched in ("vendor/a.py", "build/a.py", "gen/b_pb2.py"):
        assert (tmp_path / untouched).read_text() == DEPRECATED, untouched
    notes = json.loads(result.out)["target"]["notes"]
    assert any(n.startswith("skipped 3 links to excluded files: ") for n in notes), notes


def test_one_bad_file_does_not_stop_a_folder_walk(tmp_path, cli):
    import json

    (tmp_path / "good.py").write_text(DEPRECATED)
    (tmp_path / "latin.py").write_bytes(b"x = '\xe9'\n")  # not UTF-8, and no cookie
    (tmp_path / "dangling.py").symlink_to(tmp_path / "gone.py")
    (tmp_path / "broken.py").write_text("def f(:\n")
    os.mkfifo(tmp_path / "pipe.py")  # never opened: reading it would block forever
    result = cli("check", str(tmp_path), "--lint-only", "--format", "json", "--fail-on", "never")
    assert result.code == 0, result.err
    found = sorted((os.path.basename(f["file"]), f["rule"], f["message"]) for f in json.loads(result.out)["findings"])
    assert [(name, code) for name, code, _ in found] == [
        ("broken.py", "AMP004"), ("dangling.py", "AMP004"), ("good.py", "AMP401"), ("latin.py", "AMP004")]
    messages = {name: message for name, _, message in found}
    assert messages["latin.py"] == "not linted: is not utf-8 text"
    assert messages["dangling.py"].startswith("not linted: cannot read")
    assert messages["broken.py"].startswith("not linted: syntax error:")


@pytest.mark.parametrize("header, body", [
    (b"# -*- coding: latin-1 -*-\n", "x = '\xe9'\n".encode("latin-1")),
    (b"\xef\xbb\xbf", b"x = 1\n"),  # a UTF-8 BOM, as Windows editors write it
])
def test_encodings_python_accepts_are_linted(tmp_path, cli, header, body):
    script = tmp_path / "train.py"
    script.write_bytes(header + body + b"import torch\nscaler = torch.cuda.amp.GradScaler()\n")
    compile(script.read_bytes(), str(script), "exec")  # python runs it
    result = cli("check", str(script), "--lint-only", "--format", "json", "--fail-on", "never")
    import json

    assert result.code == 0, result.err
    assert [f["rule"] for f in json.loads(result.out)["findings"]] == ["AMP401"]


@pytest.mark.parametrize("code", [
    "x = " + " + ".join(["1"] * 1000) + "\n",
    "y = a" + ".b" * 1000 + "\n",
])
def test_deeply_nested_valid_code_is_linted(tmp_path, cli, code):
    script = tmp_path / "deep.py"
    script.write_text("import torch\nscaler = torch.cuda.amp.GradScaler()\n" + code)
    result = cli("check", str(script), "--lint-only", "--fail-on", "never")
    assert result.code == 0, result.err
    assert "AMP401" in result.out and "RecursionError" not in result.err


@pytest.mark.parametrize("header, body, encoding", [
    (b"# -*- coding: latin-1 -*-\n", "s = '\xe9t\xe9'\n", "latin-1"),
    (b"\xef\xbb\xbf", "s = '\xe9t\xe9'\n", "utf-8"),
])
def test_fix_keeps_the_files_encoding(tmp_path, cli, header, body, encoding):
    script = tmp_path / "train.py"
    script.write_bytes(header + body.encode(encoding) + DEPRECATED.encode())
    assert cli("check", str(script), "--lint-only", "--fix").code == 0
    assert script.read_bytes() == header + body.encode(encoding) + FIXED.encode()


def test_convert_refuses_a_folder_of_the_users_files(tmp_path, cli):
    from tests.conftest import ROOT

    out = tmp_path / "out"
    out.mkdir()
    (out / "module.py").write_text("# mine\n")
    (out / "notes.txt").write_text("keep\n")
    result = cli("convert", str(ROOT / "fixtures/models/clean_cnn.py"), "-o", str(out), *NO_VERIFY)
    assert result.code == 2 and "is not empty and holds no earlier ampaudit export" in result.err
    assert (out / "module.py").read_text() == "# mine\n" and sorted(p.name for p in out.iterdir()) == [
        "module.py", "notes.txt"]
    assert cli("convert", str(ROOT / "fixtures/models/clean_cnn.py"), "-o", str(out), "--force", *NO_VERIFY).code == 0
    assert (out / "notes.txt").read_text() == "keep\n"  # --force replaces the export's own names only


def test_a_second_export_replaces_the_first_completely(tmp_path, cli):
    import json

    from tests.conftest import ROOT

    out = tmp_path / "out"
    assert cli("convert", str(ROOT / "fixtures/models/untraceable.py"), "-o", str(out), *NO_VERIFY).code == 0
    assert sorted(p.name for p in out.iterdir()) == ["ampaudit-export.json", "plan.json", "weights.safetensors"]
    (out / "module.py").write_text("# an earlier export's, listed in its manifest\n")
    manifest = json.loads((out / "ampaudit-export.json").read_text())
    (out / "ampaudit-export.json").write_text(json.dumps({**manifest, "files": [*manifest["files"], "module.py",
                                                                                 "modules.pt"]}))
    (out / "modules.pt").write_text("stale\n")
    assert cli("convert", str(ROOT / "fixtures/models/untraceable.py"), "-o", str(out), *NO_VERIFY).code == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "ampaudit-export.json", "plan.json", "weights.safetensors"]  # no stale module.py or modules.pt
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no staging folder left


def test_convert_never_overwrites_the_model_file(tmp_path, cli):
    from tests.conftest import ROOT

    model = tmp_path / "module.py"
    model.write_text((ROOT / "fixtures/models/clean_cnn.py").read_text())
    result = cli("convert", str(model), "-o", str(tmp_path), "--force")
    assert result.code == 2 and "the model or a file it imported" in result.err
    assert model.read_text() == (ROOT / "fixtures/models/clean_cnn.py").read_text()


def test_report_json_is_strict_json_even_with_an_inf_norm(tmp_path, cli):
    import json

    import torch

    import ampaudit

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(3e38)  # the gradient norm overflows to inf
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    log = tmp_path / "run.jsonl"
    with ampaudit.watch(model, optimizer=opt, log=log):
        for _ in range(2):
            opt.zero_grad()
            (model(torch.ones(2, 4)) * 3e38).sum().backward()
            opt.step()
    result = cli("report", str(log), "--format", "json")
    assert result.code == 0, result.err

    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    doc = json.loads(result.out, parse_constant=refuse)
    assert "inf" in json.dumps(doc)  # the non-finite values are spelled as strings


def test_the_fix_lock_never_turns_an_unreadable_file_into_a_traceback(tmp_path, monkeypatch):
    import builtins

    from ampaudit.core import files

    target = tmp_path / "train.py"
    target.write_text("x = 1\n")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(builtins, "open", refuse)
    with files.locked(target):  # the read after it reports the file, in one line
        entered = True
    assert entered


def test_a_fix_that_would_break_the_file_is_not_written(tmp_path):
    # the AMP401 fix once wrote `custom_fwd(device_type="cuda", fn)` - a SyntaxError - into a
    # file and only the recheck noticed: an edit that leaves the file unparsable is refused
    import dataclasses

    from ampaudit.check import fix
    from ampaudit.check.lint_file import lint_file
    from ampaudit.core.findings import Edit

    script = tmp_path / "train.py"
    script.write_text(DEPRECATED)
    (finding,) = lint_file(script)
    start = DEPRECATED.index("(")
    broken = dataclasses.replace(finding, autofix=dataclasses.replace(
        finding.autofix, edits=(Edit(start, start + 1, "(device_type='cuda', x"),)))
    with pytest.raises(UsageError, match=r"the AMP401 fix would leave it invalid Python.*nothing written"):
        fix.fix_files([broken], unsafe=False, write=True)
    assert script.read_text() == DEPRECATED


def test_a_file_in_a_folder_this_user_cannot_write_says_it_is_the_folder(tmp_path, monkeypatch):
    """`check --fix w.py` as a user who may write w.py but not its folder said "cannot write
    w.py: Permission denied" - the file's mode allows it; the new text is written beside it
    (a temporary file renamed over it), which the folder refuses."""
    target = tmp_path / "w.py"
    target.write_text("x = 1\n")
    real_open = os.open

    def no_new_file(path, flags, *args, **kwargs):  # as the kernel answers a folder without write permission
        if flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_new_file)
    with pytest.raises(UsageError) as raised:
        write_atomic(target, "x = 2\n", expected="x = 1\n", shown="w.py")
    assert str(raised.value) == ("cannot write w.py: its folder is not writable (the new text is written beside the "
                                 "file, then renamed over it)")
    assert target.read_text() == "x = 1\n"
