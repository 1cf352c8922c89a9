"""Publishing an export (convert/export.py writes its files): the checks on OUT_DIR before any
work, the staging folder beside it, and the atomic swap or file-by-file move into place.

Torch-free: the command line's parent process publishes what its child process staged
(core/child.py), and never imports torch for it. What makes an export safe is said in
convert/export.py.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ampaudit.core.errors import UsageError
from ampaudit.core.files import file_id
from ampaudit.core.staging import (
    RANDOM,
    STAGING,
    cleanup_on_sigterm,
    exchange,
    new_staging,
    os_cause,
    remove_stale_staging,
    staging_home,
    swap_by_renames,
)

PLAN, WEIGHTS, MODULE = "plan.json", "weights.safetensors", "module.py"
EXPORT_ID = "export_id"  # the key of the export's id in plan.json, the manifest and the weights' metadata
EMIT_FILES = {"autocast": "autocast_policy.py", "hf": "hf_keep_in_fp32.py", "fsdp2": "fsdp2_policy.py"}
# what `convert --dtype fp8` writes (convert/fp8.py): the inputs where torch.load(weights_only=True) reads them
FP8_FILES = ("fp8_torchao.py", "fp8_plan.json", "fp8_inputs.pt")


MANIFEST = "ampaudit-export.json"
# what an export may write (and earlier versions wrote, so that a new export removes them)
_FILES = (PLAN, WEIGHTS, MODULE, *EMIT_FILES.values(), *FP8_FILES, "model.pt", "modules.pt", "weights.pt")


def seal_staging(staging: Path, names: list[str], export_id: str) -> None:
    """The manifest that makes the staged files an export (the next one may replace them whole;
    ``--force`` moves it last), and the modes any new file would get: mkdtemp makes 0700."""
    from ampaudit.core.files import umask

    manifest = {"tool": "ampaudit", EXPORT_ID: export_id, "files": names}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    mask = umask()
    os.chmod(staging, 0o777 & ~mask)
    for name in [*names, MANIFEST]:
        os.chmod(staging / name, 0o666 & ~mask)


def check_export_folder(folder: Path, *, force: bool = False, inputs: Iterable[Path | str] = ()) -> None:
    """Refuse an OUT_DIR that would lose the user's files or cannot be written - before any work
    is done. ``inputs``: files that must survive (read lazily: only when OUT_DIR holds a file
    the export would replace)."""
    folder = Path(folder)
    existing = _nearest_existing(folder)
    if existing == folder and not folder.is_dir():
        raise UsageError(f"-o {folder} is a file: give a folder to write the converted model to")
    if not existing.is_dir():  # mkdir would fail with NotADirectoryError
        raise UsageError(f"-o {folder}: {existing} is a file, not a folder")
    _check_writable(folder, existing)
    _check_inputs(folder, inputs)
    if existing == folder and any(folder.iterdir()) and _earlier_files(folder) is None and not force:
        raise UsageError(f"-o {folder} is not empty and holds no earlier ampaudit export: choose an empty "
                         "folder, or pass --force to write into it")


def _nearest_existing(folder: Path) -> Path:
    """``folder`` itself if it exists, else its nearest existing ancestor; one line for a path
    that cannot be one (a dangling link, a name too long, a loop of links)."""
    path = folder
    while True:
        try:
            os.stat(path)
            return path
        except FileNotFoundError:
            if os.path.islink(path):
                where = f"-o {folder}" if path == folder else f"-o {folder}: {path}"
                raise UsageError(f"{where} is a link to {os.readlink(path)}, which does not exist") from None
        except NotADirectoryError:
            pass  # a component above is a file: going up finds it
        except OSError as exc:
            raise UsageError(f"-o {folder}: {exc.strerror or exc}") from None
        if path.parent == path:
            return path
        path = path.parent


def _check_writable(folder: Path, existing: Path) -> None:
    target = _target(folder)
    # an existing OUT_DIR's files are replaced (staged beside it, or inside where its parent is not writable)
    place = target if existing == folder else existing
    if not os.access(place, os.R_OK | os.W_OK | os.X_OK):
        raise UsageError(f"-o {folder}: {place} is not writable")
    staging = STAGING.format(name=target.name, pid=os.getpid())
    if len(os.fsencode(staging)) + RANDOM > _name_max(place):
        raise UsageError(f"-o {folder}: the folder's name is too long (the export stages it as {staging}...)")


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255


def _check_inputs(folder: Path, inputs: Iterable[Path | str]) -> None:
    # the export's files are few: their inodes first, then the inputs (maybe every imported module)
    targets = {file_id(folder / name) for name in (*_FILES, MANIFEST)} - {None}
    if not targets:
        return
    for source in inputs:
        if file_id(source) in targets:
            raise UsageError(f"-o {folder} would overwrite {source}, the model or a file it imported: "
                             "choose another folder")


def _target(folder: Path) -> Path:
    """Where the export really goes: absolute (``-o .`` has a name) and through links, so a link
    to a folder stays a link and the staging folder lies on the same file system."""
    return Path(os.path.realpath(folder))


def _earlier_files(folder: Path) -> list[str] | None:
    """The files an earlier export listed in its manifest; None when there is no valid manifest."""
    try:
        data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list) or not all(isinstance(name, str) for name in files):
        return None
    return files


def _refuse_moved(folder: Path, target: Path) -> None:
    """The export goes where OUT_DIR was when it was checked: a folder on its path swapped for a
    link during the conversion (another user's, in a shared folder) is refused, not followed."""
    if _target(folder) != target:
        raise UsageError(f"-o {folder}: a folder on its path was replaced (by a link?) during the conversion: "
                         "nothing published")

@dataclass
class Staged:
    """An export being staged: ``path`` is the staging folder to write into; ``names`` the
    files written there (the manifest not counted); ``inputs`` more files that must survive
    (the modules a child process imported)."""

    path: Path
    names: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)


@contextlib.contextmanager
def staged_export(folder: Path, *, force: bool = False, inputs: Iterable[Path | str] = ()) -> Iterator[Staged]:
    """OUT_DIR checked, a staging folder made beside it for the block to fill, then published
    whole (or nothing, when the block raises); the staging folder is removed either way."""
    folder = Path(folder)
    check_export_folder(folder, force=force, inputs=inputs)
    target = _target(folder)
    call_reported(f"cannot create {folder.parent}", lambda: target.parent.mkdir(parents=True, exist_ok=True))
    remove_stale_staging(target)
    with cleanup_on_sigterm():
        staging = None
        try:
            staging = new_staging(target, staging_home(target))
            staged = Staged(staging)
            yield staged
            _check_inputs(folder, staged.inputs)
            _refuse_moved(folder, target)
            call_reported(f"cannot write {folder}", lambda: _publish(staging, target, staged.names))
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)  # the staged files, or the earlier export


def call_reported(what: str, action: Callable[[], object],
                  errors: tuple[type[BaseException], ...] = (OSError,)) -> None:
    """``action()``, an error of ``errors`` one line: "WHAT: its cause"."""
    try:
        action()
    except errors as exc:
        raise UsageError(f"{what}: {os_cause(exc)}") from exc


# --- publishing ---------------------------------------------------------------------------------


def _publish(staging: Path, target: Path, names: list[str]) -> None:
    """Make the staged export ``target``'s content, removing what the earlier export there wrote."""
    for _ in range(3):  # another export may create the folder meanwhile: look again
        if not os.path.lexists(target):
            try:
                os.rename(staging, target)  # the whole export appears at once
                return
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                continue
        earlier = _earlier_files(target)
        if earlier is not None and _holds_only(target, earlier) and not _holds_cwd(target) \
                and _swap(staging, target, earlier):
            return
        _move_files(staging, target, names, earlier or [])
        return
    raise OSError(errno.EEXIST, "other exports keep replacing it")


def _holds_only(folder: Path, earlier: list[str]) -> bool:
    """Whether ``folder`` holds nothing but an export's files: then it may be replaced whole."""
    allowed = {name for name in earlier if name in _FILES} | {MANIFEST}
    try:
        names = os.listdir(folder)
        return set(names) <= allowed and all(stat.S_ISREG(os.lstat(folder / n).st_mode) for n in names)
    except OSError:
        return False


def _holds_cwd(folder: Path) -> bool:
    # swapped away, the working folder would become the removed earlier export (``-o .``)
    try:
        return Path.cwd().resolve().is_relative_to(folder)
    except OSError:
        return True


def _swap(staging: Path, target: Path, earlier: list[str]) -> bool:
    """Replace ``target`` by ``staging`` whole; False when it cannot be (then files are moved).
    Afterwards ``staging`` names the earlier export, for export() to remove."""
    with contextlib.suppress(OSError):
        os.chmod(staging, stat.S_IMODE(os.stat(target).st_mode))  # the folder keeps its permissions
    try:
        exchanged = exchange(staging, target)
    except OSError:  # a mount point (EBUSY), another file system: move the files instead
        return False
    if not exchanged:
        return swap_by_renames(staging, target)
    if not _holds_only(staging, earlier):  # a file of the user's came in meanwhile: back, and move files
        exchange(staging, target)
        return False
    return True


def _move_files(staging: Path, target: Path, names: list[str], earlier: list[str]) -> None:
    """Into a folder that also holds the user's files: file by file. The manifest goes first and
    comes back last, so an interrupted move never passes for a whole export (and plan.json's id
    differs from the weights')."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(target / MANIFEST)
    for name in earlier:
        stale = target / name
        if name in _FILES and name not in names and stale.is_file() and not stale.is_symlink():
            stale.unlink()  # an earlier export's file this one does not write again
    for name in [*names, MANIFEST]:
        os.replace(staging / name, target / name)
