"""``ampaudit check PATH...``: the source lint on every file, plus the graph audit when the
target is one model file. Imports torch only when a graph audit actually runs; without torch a
model file gets its lint and AMP006, a model named on its own is an error naming the install."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ampaudit.check.lint_file import lint_file
from ampaudit.check.options import CheckOptions
from ampaudit.core.config import Config, load_config
from ampaudit.core.errors import LoadError, ModelNotBuilt, NoModelFound, UsageError
from ampaudit.core.files import file_id
from ampaudit.core.finalize import finalize
from ampaudit.core.findings import Finding, Report, Target
from ampaudit.core.paths import display_path, missing
from ampaudit.core.rulebook import rule
from ampaudit.core.torch_extra import INSTALL, TorchMissing, require_torch

if TYPE_CHECKING:
    from ampaudit.load.source_scan import SourceScan

# Folders never worth linting: VCS data, caches, build output, virtual environments.
SKIP_DIRS = frozenset({
    ".git", ".hg", ".svn", "__pycache__", ".venv", "venv", "env", ".env", "build", "dist", "node_modules",
    ".tox", ".nox", ".eggs", "site-packages", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".ipynb_checkpoints",
})
PARALLEL_FROM = 24  # files; below this, worker start-up costs more than it saves


def _excluded(path: Path, root: Path, patterns: Sequence[str]) -> bool:
    rel = path.relative_to(root).as_posix() if path != root else path.name
    return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(path.name, p) for p in patterns)


def _walked_past(path: Path, root: Path, exclude: Sequence[str]) -> bool:
    """Whether the walk of ``root`` never reaches ``path``, a file under it: a folder on the way
    is one it skips, or the file or such a folder matches ``exclude``."""
    folder = root
    for part in path.relative_to(root).parts[:-1]:
        folder = folder / part
        if part in SKIP_DIRS or (folder / "pyvenv.cfg").exists() or _excluded(folder, root, exclude):
            return True
    return _excluded(path, root, exclude)


def python_files(root: Path, exclude: Sequence[str] = (), skipped: list[Path] | None = None,
                 excluded_links: list[Path] | None = None) -> list[Path]:
    """The .py files under ``root``, skipping caches, build folders and virtual environments,
    links to files outside ``root`` (added to ``skipped``: a walk never leaves the tree) and
    links to files the walk skips or ``exclude`` names (added to ``excluded_links``: --fix
    writes through a link, so an excluded file would otherwise be rewritten)."""
    found = []
    real_root = os.path.realpath(root)
    inside = real_root + os.sep
    for folder, dirs, files in os.walk(root):
        base = Path(folder)
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not (base / d / "pyvenv.cfg").exists()
                         and not _excluded(base / d, root, exclude))
        for name in sorted(files):
            path = base / name
            if not name.endswith(".py") or _excluded(path, root, exclude):
                continue
            if path.is_symlink():
                target = os.path.realpath(path)
                if not target.startswith(inside):
                    if skipped is not None:
                        skipped.append(path)
                    continue
                if _walked_past(Path(target), Path(real_root), exclude):
                    if excluded_links is not None:
                        excluded_links.append(path)
                    continue
            if path.exists() and not path.is_file():
                continue  # a FIFO or device named *.py: opening it could block forever
            found.append(path)
    return found


def target_files(targets: Sequence[str], exclude: Sequence[str] = (), skipped: list[Path] | None = None,
                 excluded_links: list[Path] | None = None) -> list[Path]:
    """Every file ``check TARGETS`` lints: named files, and the walk of named folders. A target
    that is neither a file nor a folder (a FIFO, a device) is refused: reading it may never end."""
    files: list[Path] = []
    for spec in targets:
        path = Path(spec)
        if not path.exists():
            from ampaudit.load.spec import parse_spec

            named = parse_spec(spec).path or path  # model.py:Net: the file, for a loop's message
            raise LoadError(missing(named, "file or folder", shown=spec))
        if path.is_dir():
            files += python_files(path, exclude, skipped, excluded_links)
        elif path.is_file():
            files.append(path)
        else:
            raise LoadError(f"{spec} is not a regular file or a folder (a FIFO or a device): not read")
    return _once_each(files)


def _once_each(files: list[Path]) -> list[Path]:
    """One path per file: a file reached by several names (links, hard links) is linted and
    fixed once, under its own name rather than a link's; a path that cannot be read stays, for
    its AMP004."""
    chosen: dict[object, Path] = {}
    for path in files:
        key = file_id(path) or path
        if key not in chosen or (chosen[key].is_symlink() and not path.is_symlink()):
            chosen[key] = path
    keep = set(chosen.values())
    return [p for p in files if p in keep]


def _lint_many(files: list[Path], options: CheckOptions) -> list[Finding]:
    tick = options.progress(len(files)) if options.progress and len(files) >= PARALLEL_FROM else None
    if len(files) < PARALLEL_FROM or options.jobs == 1:
        findings = []
        for path in files:
            findings += _lint_in_worker(path)
            if tick:
                tick()
        return findings
    findings = []
    with ProcessPoolExecutor(max_workers=options.jobs) as pool:
        for result in pool.map(_lint_in_worker, files, chunksize=8):
            findings += result
            if tick:
                tick()
    return findings


def _lint_in_worker(path: Path) -> list[Finding]:
    # A module-level function, so worker processes can receive it.
    return lint_file(path, syntax_errors_as_findings=True)


def config_for(targets: Sequence[str]) -> Config:
    """The ``[tool.ampaudit]`` settings ``ampaudit check TARGETS`` reads: the nearest
    pyproject.toml above the first target's file, or above the current folder for a model
    named without a file."""
    from ampaudit.load.spec import parse_spec

    first = parse_spec(targets[0]) if targets else None
    if first is None or first.kind == "file":
        return load_config(first.path if first is not None and first.path.exists() else None)
    return load_config(Path.cwd())


def check_targets(targets: Sequence[str], config: Config, options: CheckOptions) -> Report:
    """Lint every target (files, folders) and, for a single model file, audit its graph; a
    model named without a file (``torch.nn:"Linear(4, 4)"``, ``hf:gpt2``) has only the graph."""
    from ampaudit.load.spec import parse_spec

    if options.policy_files:  # read whatever is checked: a policy file that cannot be read is never silently unused
        from ampaudit.core.catalog import build_catalog

        build_catalog(config, policy_files=options.policy_files)
    specs = [parse_spec(t) for t in targets]
    models = [s.text for s in specs if s.kind != "file"]
    if models and (len(targets) > 1 or options.lint_only):
        raise UsageError(f"{models[0]} names a model, not a file: check it on its own, without --lint-only")
    if len(targets) == 1:
        if models:
            return _check_model(targets[0], config, options)
        if specs[0].path.is_file():
            return _check_file(targets[0], specs[0].path, specs[0].selector, config, options)
    skipped: list[Path] = []
    excluded_links: list[Path] = []
    files = target_files(targets, options.exclude, skipped, excluded_links)
    findings = _lint_many(files, options)
    notes = [f"linted {len(files)} Python file{'s' if len(files) != 1 else ''}", *options.notes]
    for links, where in ((skipped, "files outside the folder"), (excluded_links, "excluded files")):
        if links:
            notes.append(f"skipped {len(links)} link{'s' if len(links) != 1 else ''} to {where}: "
                         f"{', '.join(display_path(str(p)) for p in links[:3])}")
    target = Target(", ".join(display_path(t) for t in targets), "", "none", notes)
    return finalize(Report(target, config.dtype, [], findings), config)


def _check_model(spec: str, config: Config, options: CheckOptions) -> Report:
    report = _graph(spec, config, options)
    report.target.notes += options.notes
    return finalize(report, config)


def _graph(spec: str, config: Config, options: CheckOptions) -> Report:
    """The graph audit of the model ``spec`` names, where the model's code runs: in a child
    process for the command line (``options.isolate``: whatever that code does ends there),
    here for the Python API. Without torch: TorchMissing, naming what is missing."""
    if options.isolate:
        from ampaudit.core.child import run_in_child

        inside = replace(options, isolate=False, progress=None, import_timeout=None)  # the parent keeps the clock
        return run_in_child(__name__, "_graph", spec, config, inside, import_timeout=options.import_timeout)
    require_torch(f"auditing {spec}")
    from ampaudit.check.audit import graph_report  # imports torch

    return graph_report(spec, config, options)


def _check_file(spec: str, path: Path, name: str | None, config: Config, options: CheckOptions) -> Report:
    """``name``: what the user named after the colon (NAME or EXPR), None for the file's own entry point."""
    from ampaudit.load.source_scan import FACTORY_NAMES, scan_source
    from ampaudit.load.spec import read_source

    if options.lint_only:  # no import, so no import-safety scan: the lint alone says what is wrong with the file
        return _lint_only(path, lint_file(path), "--lint-only", config, options)
    source = read_source(path)
    scan = scan_source(path, source)  # syntax errors: exit 2 with file:line
    lint = lint_file(path)
    if name is None and not scan.has_entry_point:
        why = "no model entry point (get_model(), `model`, an nn.Module class)"
        imported = [f for f in FACTORY_NAMES if f in scan.imported_from]
        if imported:
            source = scan.imported_from[imported[0]]
            why += (f"; its {imported[0]} comes from {source}: audit a model that builds with "
                    f"`ampaudit check {source}:\"{imported[0]}(...)\"`")
        return _lint_only(path, lint, why, config, options)
    try:
        report = _refused_import(spec, scan, config, options) or _graph(spec, config, options)
    except TorchMissing as exc:
        if name is not None:  # the user named the model: auditing it is the point
            raise
        return _needs_torch(path, source, lint, exc.missing, config, options)
    except NoModelFound as exc:
        if name is not None:
            raise
        return _lint_only(path, lint, str(exc), config, options)
    except ModelNotBuilt as exc:
        if name is not None:  # the user named the model: building it is the point
            raise
        return _graph_skipped(path, lint, exc, config, options)
    report.findings += lint
    report.target.notes += options.notes
    return finalize(report, config)


def _refused_import(spec: str, scan: SourceScan, config: Config, options: CheckOptions) -> Report | None:
    """AMP003 decided from the source, here, before torch is imported or a child started: a
    training script that will not be imported costs its lint and nothing more. None when the
    file will be imported, or when the loader must say what is wrong with the name."""
    from ampaudit.check.not_imported import not_imported_report
    from ampaudit.check.options import audit_dtype
    from ampaudit.core.catalog import build_catalog
    from ampaudit.load.source_scan import not_imported
    from ampaudit.load.spec import parse_spec

    target = parse_spec(spec)
    if target.name is not None and target.name not in scan.names:
        return None
    skipped = not_imported(scan, target.selector, options.allow_exec)
    if skipped is None:
        return None
    dtype = audit_dtype(options, config)  # --dtype fp8 is no LowDtype name: the import's path says the same
    if config.policy or options.policy_files:  # a bad policy fails, imported or not; the builtin one is sound
        build_catalog(config, policy_files=options.policy_files)
    return not_imported_report(skipped, dtype)


def _lint_only(path: Path, lint: list[Finding], why: str, config: Config, options: CheckOptions) -> Report:
    target = Target(display_path(str(path)), "", "none", [f"training-script lint only: {why}", *options.notes])
    return finalize(Report(target, config.dtype, [], lint), config)


def _graph_skipped(path: Path, lint: list[Finding], exc: ModelNotBuilt, config: Config,
                   options: CheckOptions) -> Report:
    """Importing the file or building its model failed: the lint still stands, and an AMP005
    finding says why there is no graph audit and how to get one."""
    file = display_path(str(path))
    finding = rule("AMP005").finding(file, exc.line or 1, reason=exc.reason, hint=exc.hint)
    target = Target(file, "", "none", [f"training-script lint only: graph audit skipped ({exc.reason})",
                                       *options.notes])
    return finalize(Report(target, config.dtype, [], [finding, *lint]), config)


def _needs_torch(path: Path, source: str, lint: list[Finding], missing: str, config: Config,
                 options: CheckOptions) -> Report:
    """A model file without torch (``pip install ampaudit`` alone): the lint stands, and AMP006,
    at the file's first import of torch, says the graph audit needs ``ampaudit[torch]``."""
    file = display_path(str(path))
    finding = rule("AMP006").finding(file, _torch_import_line(source), reason=missing, install=INSTALL)
    target = Target(file, "", "none", [f"training-script lint only: the graph audit needs {missing} ({INSTALL})",
                                       *options.notes])
    return finalize(Report(target, config.dtype, [], [finding, *lint]), config)


def _torch_import_line(source: str) -> int:
    """The line of the file's first top-level ``import torch...`` / ``from torch... import``; 1 if none."""
    import ast

    from ampaudit.core.python_source import run_deep

    # it parses, deep as the scan parsed it: scan_source raised on a syntax error or nesting past that
    for node in run_deep(ast.parse, source).body:
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(m == "torch" or m.startswith("torch.") for m in modules):
            return node.lineno
    return 1
