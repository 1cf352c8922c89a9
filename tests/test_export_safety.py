"""``ampaudit convert -o OUT_DIR`` exports survive crashes, races and bad folders: the swap of an
earlier export is atomic, a reader refuses a mix of two exports, staging folders never stay
behind, modes follow the umask, --force never overwrites a module the model imported, bad
folders and failed writes are one-line errors before (or instead of) a traceback."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ampaudit
from ampaudit.convert import export as export_module
from ampaudit.convert import publish
from ampaudit.convert.export import export
from ampaudit.convert.publish import MANIFEST, PLAN, WEIGHTS, check_export_folder
from ampaudit.core.errors import UsageError
from tests.conftest import ROOT

FIXTURES = ROOT / "fixtures" / "export_safety"
NO_VERIFY = ("--no-verify", "--train-steps", "0")


def mlp(seed: int) -> nn.Module:
    """fixtures/export_safety/interrupted_export.py builds the same model."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


def converted(seed: int) -> nn.Module:
    return ampaudit.convert(mlp(seed), example_inputs=(torch.randn(2, 4),), verify=False)


@functools.cache
def weights(seed: int) -> dict[str, torch.Tensor]:
    return converted(seed).state_dict()


def export_seed(seed: int, out: Path, **kwargs) -> list[Path]:
    model_mp = converted(seed)
    return export(model_mp, out, summary={**model_mp.summary.to_dict(), "notes": [f"seed {seed}"]}, **kwargs)


def loaded_seed(out: Path) -> int:
    """The seed of the export in ``out``: its plan's and its weights' must agree."""
    plan_seed = int(json.loads((out / PLAN).read_text())["summary"]["notes"][0].split()[1])
    state = ampaudit.apply(mlp(99), out).state_dict()
    weight_seeds = [seed for seed in (0, 1, 2) if all(torch.equal(state[k], v)
                                                      for k, v in weights(seed).items())]
    assert weight_seeds == [plan_seed], f"plan.json of seed {plan_seed}, weights of {weight_seeds}"
    return plan_seed


def staging_folders(parent: Path, name: str = "out") -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}.ampaudit-"))


def run_interrupted(out: Path, seed: int, how: str, step: int = 0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(FIXTURES / "interrupted_export.py"), str(out), str(seed), how,
                           str(step)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # this checkout, whatever is installed


@pytest.mark.parametrize(("how", "users_file"), [("kill-before", False), ("kill-after", False),
                                                 ("kill-after", True)])
def test_a_killed_export_leaves_one_whole_export_and_no_staging(tmp_path, how, users_file):
    out = tmp_path / "out"
    export_seed(0, out)
    if users_file:  # --force into a folder of the user's: the files move one by one
        (out / "notes.txt").write_text("keep\n")
    proc = run_interrupted(out, 1, how, step=1)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert staging_folders(tmp_path), "the killed export's staging folder is the next export's to remove"
    if users_file:  # plan.json moved, weights not yet: a reader must refuse the mix
        with pytest.raises(UsageError, match="come from two different exports"):
            ampaudit.apply(mlp(99), out)
    else:
        assert loaded_seed(out) == (0 if how == "kill-before" else 1)
    export_seed(2, out, force=True)
    assert loaded_seed(out) == 2 and staging_folders(tmp_path) == []
    assert not users_file or (out / "notes.txt").read_text() == "keep\n"


def test_sigterm_during_an_export_removes_its_staging_folder(tmp_path):
    proc = run_interrupted(tmp_path / "out", 1, "sigterm")
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr  # still ends by SIGTERM
    assert staging_folders(tmp_path) == [] and not (tmp_path / "out").exists()


def test_only_staging_folders_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    stale, live = f".out.ampaudit-{int(dead.stdout)}-abcd1234", f".out.ampaudit-{os.getpid()}-abcd1234"
    for name in (stale, live):
        (tmp_path / name).mkdir()
        (tmp_path / name / PLAN).write_text("{}")
    export_seed(0, tmp_path / "out")
    assert staging_folders(tmp_path) == [live]  # a live export's is never touched


def test_a_swap_without_renameat2_falls_back_to_renames(tmp_path, monkeypatch):
    out = tmp_path / "out"
    export_seed(0, out)
    monkeypatch.setattr(publish, "exchange", lambda a, b: False)  # ENOSYS, EINVAL, no symbol
    export_seed(1, out)
    assert loaded_seed(out) == 1 and staging_folders(tmp_path) == []


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_modes_follow_the_umask(tmp_path, umask):
    before = os.umask(umask)
    try:
        export_seed(0, tmp_path / "out")
    finally:
        os.umask(before)
    out = tmp_path / "out"
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~umask)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {
        name: oct(0o666 & ~umask) for name in (PLAN, WEIGHTS, "module.py", MANIFEST)}


def test_apply_refuses_a_plan_and_weights_of_two_exports(tmp_path):
    export_seed(0, tmp_path / "a")
    export_seed(1, tmp_path / "b")
    ids = {json.loads((tmp_path / "a" / name).read_text())["export_id"] for name in (PLAN, MANIFEST)}
    assert len(ids) == 1 and len(ids.pop()) == 32  # one uuid4 hex per export
    shutil.copy(tmp_path / "b" / WEIGHTS, tmp_path / "a" / WEIGHTS)
    with pytest.raises(UsageError, match=r"a: plan.json and weights.safetensors come from two different exports "
                                         r"\(an export was interrupted\): export again"):
        ampaudit.apply(mlp(99), tmp_path / "a")
    plan = json.loads((tmp_path / "a" / PLAN).read_text())
    del plan["export_id"]  # as exports made before ids: still loads
    (tmp_path / "a" / PLAN).write_text(json.dumps(plan))
    ampaudit.apply(mlp(99), tmp_path / "a")


def test_force_never_overwrites_a_module_the_model_imported(tmp_path, cli):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES, src, ignore=shutil.ignore_patterns("interrupted_export.py", "__pycache__"))
    saved = {name: sys.modules.pop(name) for name in ("module", "m") if name in sys.modules}
    try:  # another test's "module" must not stand in for this sibling
        result = cli("convert", src / "m.py", "-o", src, "--force", *NO_VERIFY)
    finally:
        for name in ("module", "m"):
            sys.modules.pop(name, None)
        sys.modules.update(saved)
    assert result.code == 2 and "the model or a file it imported" in result.err
    assert str(src / "module.py") in result.err and len(result.err.strip().splitlines()) == 1
    assert (src / "module.py").read_text() == (FIXTURES / "module.py").read_text()
    assert sorted(p.name for p in src.iterdir()) == ["m.py", "module.py"]


def _read_only(monkeypatch, folder: Path) -> None:
    folder.chmod(0o555)
    if os.geteuid() == 0:  # root writes anyway: answer os.access as for any other user
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: (Path(p) != folder or not mode & os.W_OK)
                            and real(p, mode, **kw))


@pytest.mark.parametrize("case", ["dangling-link", "file-parent", "read-only-parent", "name-too-long",
                                  "staging-name-too-long"])
def test_a_folder_that_cannot_be_written_is_refused_before_the_work(tmp_path, monkeypatch, case):
    if case == "dangling-link":
        folder = tmp_path / "out"
        folder.symlink_to(tmp_path / "missing")
        message = f"{folder} is a link to {tmp_path / 'missing'}, which does not exist"
    elif case == "file-parent":
        (tmp_path / "file").write_text("")
        folder, message = tmp_path / "file" / "out", f"{tmp_path / 'file'} is a file, not a folder"
    elif case == "read-only-parent":
        (tmp_path / "ro").mkdir()
        _read_only(monkeypatch, tmp_path / "ro")
        folder, message = tmp_path / "ro" / "sub" / "out", f"{tmp_path / 'ro'} is not writable"
    elif case == "name-too-long":
        folder, message = tmp_path / ("x" * 300), "File name too long"
    else:  # fits, but its staging folder .NAME.ampaudit-PID-XXXXXXXX would not
        folder, message = tmp_path / ("x" * 250), "the folder's name is too long"
    try:
        with pytest.raises(UsageError, match=f"^-o {folder}[: ]") as raised:
            check_export_folder(folder)
        assert message in str(raised.value) and "\n" not in str(raised.value)
    finally:
        if (tmp_path / "ro").exists():
            (tmp_path / "ro").chmod(0o755)  # for pytest to remove it


def test_the_cli_refuses_a_dangling_link_before_loading_the_model(tmp_path, cli):
    (tmp_path / "out").symlink_to(tmp_path / "missing")
    result = cli("convert", "fixtures/models/no_such_model.py", "-o", tmp_path / "out", *NO_VERIFY)
    assert result.code == 2 and result.err.count("\n") == 1 and "which does not exist" in result.err


def test_a_failed_write_of_the_weights_is_one_line(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    def full(*args, **kwargs):  # what safetensors raises for EFBIG (ulimit -f) or ENOSPC
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(export_module, "save_model", full)
    with pytest.raises(UsageError, match=f"^cannot write {tmp_path / 'out' / WEIGHTS}: No space left on device$"):
        export_seed(0, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_under_ulimit_f_is_one_line(tmp_path):
    resource = pytest.importorskip("resource")
    model_mp = ampaudit.convert(nn.Linear(64, 64), example_inputs=(torch.randn(2, 64),), verify=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (6000, hard))  # plan.json fits, the 8 kB of weights do not
    try:
        with pytest.raises(UsageError, match=f"^cannot write {tmp_path / 'out' / WEIGHTS}: File too large$"):
            export(model_mp, tmp_path / "out")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("manifest", ["[1, 2]", '{"files": 5}', '{"files": [1]}', "not json"])
def test_a_manifest_that_lists_no_files_is_no_earlier_export(tmp_path, manifest):
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST).write_text(manifest)
    (out / PLAN).write_text("{}")
    with pytest.raises(UsageError, match="is not empty and holds no earlier ampaudit export"):
        export_seed(0, out)
    export_seed(0, out, force=True)
    assert loaded_seed(out) == 0 and json.loads((out / MANIFEST).read_text())["files"] == [PLAN, WEIGHTS,
                                                                                           "module.py"]
