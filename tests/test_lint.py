"""The training-script lint: aliases, scopes, clean loops, folders, --fix / --diff, pre-commit."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ampaudit.check.lint_file import lint_source
from ampaudit.check.options import CheckOptions
from ampaudit.check.run import check_targets, python_files
from ampaudit.core.config import Config
from tests.conftest import ROOT, RULE_FIXTURES, expected_markers

SCRIPTS = ROOT / "fixtures" / "scripts"


def _codes(findings):
    return [(f.line, f.rule) for f in findings]


def test_aliases_resolve_to_their_torch_names():
    path = SCRIPTS / "aliases.py"
    findings = lint_source(str(path), path.read_text())
    assert sorted(_codes(findings)) == sorted(expected_markers(path))


def _fixed(source, findings):
    from ampaudit.check.fix import fixable
    from ampaudit.check.lint import edits

    return edits.apply(source, (e for f in fixable(findings, unsafe=False) for e in f.autofix.edits))[0]


def test_a_star_import_of_the_old_amp_module_is_reported_and_its_names_resolve():
    # `from torch.cuda.amp import *`: AMP401 at the import, listing the uses of its names;
    # GradScaler() and autocast() are torch's to the other rules too (AMP405, AMP403).
    path = SCRIPTS / "star_import.py"
    source = path.read_text()
    findings = lint_source(str(path), source)
    assert sorted(_codes(findings)) == sorted(expected_markers(path))
    (deprecated,) = [f for f in findings if f.rule == "AMP401"]
    assert deprecated.message.endswith("(also at lines 8, 10, 19, 27)")
    fixed = _fixed(source, findings)
    assert [line for line in fixed.splitlines() if "amp import" in line or '"cuda"' in line] == [
        "from torch.amp import *  # expect: AMP401",
        '    scaler = GradScaler("cuda")  # listed by the import\'s AMP401',
        '        with autocast("cuda"):  # listed too',
        '        with autocast("cuda"):  # expect: AMP403',
        '    with autocast("cuda", dtype=torch.float16):  # listed, and rewritten by the import\'s fix']
    # the fixed file runs, torch.amp's names bound by its star import: no NameError, no
    # TypeError for a missing device, no deprecation warning
    import warnings

    import torch
    scope = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.filterwarnings("ignore", "CUDA is not available|.*torch.cuda.amp.GradScaler is enabled")
        exec(compile(fixed, str(path), "exec"), scope)
        model = torch.nn.Linear(2, 1)
        batches = [(torch.ones(3, 2), torch.zeros(3, 1))]
        scope["train"](model, torch.optim.SGD(model.parameters(), lr=0.1), batches)
        scope["train_unscaled"](model, torch.optim.SGD(model.parameters(), lr=0.1), batches)
        assert scope["evaluate"](model, torch.ones(1, 2)).shape == (1, 1)


@pytest.mark.parametrize(("source", "line", "listed"), [
    # a name the old module's star binds and torch.amp's does not: rewriting the import would
    # unbind it
    ("from torch.cuda.amp import *\nwith autocast():\n    pass\nok = not amp_definitely_not_available()\n",
     1, " (also at line 2)"),
    ("from torch.cuda.amp import *\nwith autocast():\n    pass\n\ndef usable():\n"
     "    return not amp_definitely_not_available()\n", 1, " (also at line 2)"),  # read inside a function too
    # torch.cpu.amp's star binds its modules' names too: a use of one keeps the import
    ("import torch\nfrom torch.cpu.amp import *\nwith autocast(dtype=torch.bfloat16):\n    pass\n"
     "print(autocast_mode.__name__)\n", 2, " (also at line 3)"),
])
def test_a_star_import_whose_names_cannot_all_be_rewritten_gets_no_fix(source, line, listed):
    (found,) = lint_source("s.py", source)
    assert (found.rule, found.line, found.autofix) == ("AMP401", line, None)
    assert found.message.endswith("import` is deprecated: use `from torch.amp import`" + listed)


@pytest.mark.parametrize("names", ["GradScaler, autocast", "*"])
def test_a_name_imported_from_torch_amp_keeps_that_binding_over_its_fallback(names):
    # on the torch the script runs under, the `try` imports: `GradScaler()` is torch.amp's,
    # no deprecated API is used (the fallback's import itself is left alone)
    source = (f"import torch\ntry:\n    from torch.amp import {names}\n"
              f"except ImportError:\n    from torch.cuda.amp import {names}\n\n"
              "def train(model, x, optimizer):\n    scaler = GradScaler()\n"
              "    with autocast(\"cuda\"):\n        loss = model(x)\n"
              "    scaler.scale(loss).backward()\n    optimizer.step()\n")
    assert _codes(lint_source("s.py", source)) == [(12, "AMP405")]


def test_torch_cpu_amp_s_grad_scaler_is_deprecated_too():
    # `torch.cpu.amp.GradScaler(...)` warns as torch.cuda.amp's does; a GradScaler to the other rules
    source = ("import torch\nfrom torch.cpu.amp import *\n\ndef train(model, x, optimizer):\n"
              "    scaler = GradScaler(2.0**10)\n    with autocast(dtype=torch.float16):\n"
              "        loss = model(x).sum()\n    scaler.scale(loss).backward()\n    optimizer.step()\n")
    findings = lint_source("s.py", source)
    assert [(f.line, f.rule, f.message) for f in findings] == [
        (2, "AMP401", "`from torch.cpu.amp import` is deprecated: use `from torch.amp import` (also at lines 5, 6)"),
        (9, "AMP405", "`optimizer.step()` bypasses scaler: use `scaler.step(optimizer)`")]
    assert [line.strip() for line in _fixed(source, findings).splitlines()[1:6:3]] == [
        "from torch.amp import *", 'scaler = GradScaler("cpu", 2.0**10)']


@pytest.mark.parametrize("output", ["text", "json", "github", "sarif"])
def test_the_lines_of_a_deprecated_name_s_other_uses_are_capped_in_every_format(tmp_path, cli, output):
    # a generated file uses the old autocast on 5,000 lines: the message names the first ten
    uses = "".join(f"x{i} = torch.cuda.amp.autocast(enabled=True)\n" for i in range(5000))
    script = tmp_path / "big.py"
    script.write_text("import torch\n" + uses)
    tail = "(also at lines 3, 4, 5, 6, 7, 8, 9, 10, 11, 12 and 4989 more)"
    result = cli("check", str(script), "--lint-only", "--format", output)
    assert result.code == 1 and tail in " ".join(result.out.split())  # the terminal wraps it
    assert "5001" not in result.out and len(result.out) < 200_000  # none of the lines past the tenth
    fix = lint_source("big.py", script.read_text())[0].autofix
    assert len({e.start for e in fix.edits}) == 2 * 5000  # the fix still rewrites every use


def test_a_star_import_of_torch_amp_is_not_reported():
    assert lint_source("s.py", "from torch.amp import *\nwith autocast(\"cuda\"):\n    pass\n") == []


@pytest.mark.parametrize("name", ["clean_amp_loop.py", "clean_bf16_loop.py"])
def test_clean_loops_have_no_findings_at_all(cli, name):
    result = cli("check", f"fixtures/scripts/{name}", "--format", "json", "--fail-on", "info")
    assert result.code == 0
    assert result.json()["findings"] == []


def test_rules_stay_inside_one_function():
    source = (
        "import torch\n\n"
        "def forward_only(model, x):\n"
        "    with torch.autocast('cuda'):\n"
        "        return model(x)\n\n"
        "def learn(loss, optimizer):\n"
        "    loss.backward()\n"
        "    optimizer.step()\n\n"
        "def scaled(loss, scaler, optimizer):\n"
        "    scaler.scale(loss).backward()\n"
        "    scaler.step(optimizer)\n"
        "    scaler.update()\n"
    )
    assert lint_source("t.py", source) == []


_FAIRSEQ = (
    "import torch\n"
    "from fairseq import optim\n\n"
    "def train(cfg, net, loader):\n"
    "    model = net.half()\n"
    "    params = [p for p in model.parameters() if p.requires_grad]\n"
    "    optimizer = optim.FP16Optimizer.build_optimizer(cfg, params)\n"
    "    model.train()\n"
)
_PLAIN = (
    "\ndef other(net, loader):\n"
    "    model = net.half()\n"
    "    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "    model.train()\n"
)


def test_a_master_weight_optimizer_covers_its_own_model_only():
    # fairseq's optimizer is built through a class method of FP16Optimizer: it keeps the masters
    assert _codes(lint_source("t.py", _FAIRSEQ)) == []
    # another function's `model`, trained by plain SGD, is another model: still AMP411
    assert [c for c in _codes(lint_source("t.py", _FAIRSEQ + _PLAIN)) if c[1] == "AMP411"] == [(11, "AMP411")]


# NVIDIA DeepLearningExamples' wav2vec2 train.py: the fp16 model's optimizer comes from a helper
# module (fairseq's FP16Optimizer, fp32 masters inside) and is used as one: optim.backward(loss)
_HELPER_FP16_OPTIMIZER = """\
import torch
from common.optimizers import get_optimizer


def main(args, model, loader):
    if args.fp16:
        model.half()
    optim = get_optimizer(model, args)
    model.train()
    for batch in loader:
        loss = model(batch).sum()
        if args.fp16:
            BACKWARD
        else:
            loss.backward()
        optim.step()
        optim.zero_grad()
"""


def test_an_optimizer_that_takes_the_loss_in_backward_keeps_fp32_masters():
    wrapper = _HELPER_FP16_OPTIMIZER.replace("BACKWARD", "optim.backward(loss)")
    assert [f for f in lint_source("t.py", wrapper) if f.rule == "AMP411"] == []
    # only an optimizer has that interface: accelerate's backward(loss) keeps no fp16 model's masters
    for backward in ("accelerator.backward(loss)", "loss.backward()"):
        plain = _HELPER_FP16_OPTIMIZER.replace("BACKWARD", backward)
        assert [(f.line, f.rule) for f in lint_source("t.py", plain) if f.rule == "AMP411"] == [(7, "AMP411")]


# I-JEPA's train.py (facebookresearch/ijepa): the scaler comes out of a helper module with the
# optimizer, and the only autocast is bf16 - the file never builds the GradScaler AMP409 asks of
_HELPER_SCALER = """\
import torch
from src.helper import init_opt


def main(encoder, loader, use_bfloat16=True):
    optimizer, scaler = init_opt(encoder, use_bfloat16=use_bfloat16)
    for imgs in loader:
        def train_step():
            with torch.cuda.amp.autocast(dtype=AMP_DTYPE, enabled=use_bfloat16):
                loss = encoder(imgs).mean()
            if use_bfloat16:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
        train_step()
"""


def test_a_scaler_built_in_another_module_is_heard_with_bf16_autocast():
    bf16 = lint_source("t.py", _HELPER_SCALER.replace("AMP_DTYPE", "torch.bfloat16"))
    assert [(f.line, f.column, f.rule) for f in bf16 if f.rule == "AMP409"] == [(12, 17, "AMP409")]
    # V-JEPA's variant: the dtype is a variable that can be float16 - the scaler may be needed
    variable = lint_source("t.py", _HELPER_SCALER.replace("AMP_DTYPE", "dtype"))
    assert [f for f in variable if f.rule == "AMP409"] == []
    # no autocast in the scaling function: its loss may come from another module's fp16 autocast
    elsewhere = _HELPER_SCALER.replace("AMP_DTYPE", "torch.bfloat16") + (
        "\n\ndef step(loss, scaler, optimizer):\n    scaler.scale(loss).backward()\n    scaler.step(optimizer)\n")
    assert [(f.line, f.rule) for f in lint_source("t.py", elsewhere) if f.rule == "AMP409"] == [(12, "AMP409")]
    # accelerate's MS-AMP benchmarks: the helper's scaler scales FP8 gradients under bf16 autocast
    fp8 = "import msamp\n" + _HELPER_SCALER.replace("AMP_DTYPE", "torch.bfloat16")
    assert [f for f in lint_source("t.py", fp8) if f.rule == "AMP409"] == []


# VideoMAEv2's engine_for_finetuning.py: timm's NativeScaler, built in run_class_finetuning.py,
# called as loss_scaler(loss, optimizer, ...) under bf16; the file's fp16 autocasts are eval-only
_HELPER_LOSS_SCALER = """\
import torch


def train_one_epoch(model, criterion, loader, optimizer, loss_scaler, max_norm=None):
    for samples, targets in loader:
        with torch.cuda.amp.autocast(dtype=torch.bfloat16):
            loss = criterion(model(samples), targets)
        grad_norm = loss_scaler(loss, optimizer, clip_grad=max_norm, parameters=model.parameters())
        optimizer.zero_grad()


@torch.no_grad()
def validation_one_epoch(model, loader):
    for samples, _ in loader:
        with torch.cuda.amp.autocast():
            model(samples)
"""


def test_a_timm_loss_scaler_built_in_another_module_is_heard_with_bf16_autocast():
    found = [(f.line, f.column, f.rule) for f in lint_source("t.py", _HELPER_LOSS_SCALER) if f.rule == "AMP409"]
    assert found == [(8, 21, "AMP409")]
    fp16 = _HELPER_LOSS_SCALER.replace("autocast(dtype=torch.bfloat16)", "autocast()")
    assert [f for f in lint_source("t.py", fp16) if f.rule == "AMP409"] == []


def _copy(tmp_path, name):
    target = tmp_path / name
    shutil.copy(RULE_FIXTURES / name, target)
    return target


def test_fix_rewrites_deprecated_apis_and_keeps_everything_else(cli, tmp_path):
    path = _copy(tmp_path, "AMP401_invalid.py")
    before = path.read_text()
    os.chmod(path, 0o640)
    result = cli("check", path, "--fix", "--format", "json")
    assert "Fixed 7 findings in 1 file(s)." in result.err  # one per deprecated binding
    after = path.read_text()
    assert "from torch.amp import GradScaler, autocast  # expect: AMP401" in after
    assert '    @torch.amp.custom_fwd(device_type="cuda")  # expect: AMP401' in after
    assert '    scaler = GradScaler("cuda")  # listed by the import\'s finding' in after
    assert '        with autocast("cuda", dtype=torch.float16):  # listed too: one finding per binding' in after
    assert '    with torch.amp.autocast("cuda"):  # listed by line 34\'s finding, fixed with it' in after
    # the modules that define the old classes: the new modules, the same names
    assert "from torch.amp.grad_scaler import GradScaler as Scaler, OptState  # expect: AMP401" in after
    assert '        with autocast_of_module("cuda", enabled=True):  # listed by its import\'s finding' in after
    assert '    with torch.amp.autocast("cuda", dtype=torch.float16):  # listed by line 34\'s finding too' in after
    assert '    with torch.amp.autocast("cuda", enabled=True):  # expect: AMP401' in after
    assert '    scaler = torch.amp.GradScaler("cpu", 2.0**10)  # expect: AMP401' in after
    # Only the fixed spans changed: same number of lines, every other line identical.
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines(), strict=True) if a != b]
    assert len(changed) == 13
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert [f for f in result.json()["findings"] if f["rule"] == "AMP401"] == []
    compile(after, str(path), "exec")


@pytest.mark.parametrize(("name", "inserted"), [
    ("AMP405_invalid.py", "        scaler.step(optimizer)  # expect: AMP405"),
    ("AMP406_invalid.py", "        scaler.unscale_(optimizer)\n        nn.utils.clip_grad_norm_"),
    ("AMP407_invalid.py", "        scaler.step(optimizer)  # expect: AMP407\n        scaler.update()\n"),
    ("AMP414_invalid.py", "scores.masked_fill(mask, torch.finfo(scores.dtype).min)"),
])
def test_unsafe_fixes_need_the_flag_and_then_resolve_the_finding(cli, tmp_path, name, inserted):
    code = name[:6]
    path = _copy(tmp_path, name)
    before = path.read_text()
    result = cli("check", path, "--fix")
    assert path.read_text() == before  # behaviour-changing: not applied by --fix alone
    assert "more fixable with --unsafe-fixes" in result.err
    result = cli("check", path, "--fix", "--unsafe-fixes", "--format", "json")
    assert inserted in path.read_text()
    remaining = [f["line"] for f in result.json()["findings"] if f["rule"] == code]
    expected_left = {"AMP414": 5}.get(code, 0)  # full/where/full_like/clamp values have no automatic fix
    assert len(remaining) == expected_left
    compile(path.read_text(), str(path), "exec")


def test_fix_and_recheck_is_the_fix_loop_as_a_function(tmp_path):
    from ampaudit.check.fix import fix_and_recheck

    path = _copy(tmp_path, "AMP414_invalid.py")  # its fixes change behaviour: unsafe only
    before = path.read_text()
    run = fix_and_recheck([str(path)])  # the config `ampaudit check` would read
    assert (run.files, run.fixed, run.unsafe_left) == ([], 0, 2) and path.read_text() == before
    run = fix_and_recheck([str(path)], Config(), unsafe=True)
    assert len(run.files) == 1 and run.fixed == 2 and run.unsafe_left == 0
    assert path.read_text() != before
    # the report is of the rewritten file: only the findings with no automatic fix are left
    assert [f.line for f in run.report.findings if f.rule == "AMP414"] == [9, 14, 15, 16, 17]
    assert run.report.findings == check_targets([str(path)], Config(), CheckOptions()).findings


def test_diff_prints_and_writes_nothing(cli, tmp_path):
    path = _copy(tmp_path, "AMP401_invalid.py")
    before = path.read_bytes()
    mtime = path.stat().st_mtime_ns
    result = cli("check", path, "--diff")
    assert result.code == 1
    assert path.read_bytes() == before and path.stat().st_mtime_ns == mtime
    assert result.out.startswith(f"--- a/{path}\n+++ b/{path}\n")
    assert '-from torch.cuda.amp import GradScaler, autocast  # expect: AMP401' in result.out
    assert '+from torch.amp import GradScaler, autocast  # expect: AMP401' in result.out
    assert "7 fixes would be applied to 1 file(s)" in result.err  # one per deprecated binding


def test_fix_keeps_crlf_line_endings(cli, tmp_path):
    path = tmp_path / "crlf.py"
    path.write_bytes(b"import torch\r\n\r\nscaler = torch.cuda.amp.GradScaler()\r\n")
    cli("check", path, "--fix")
    assert path.read_bytes() == b'import torch\r\n\r\nscaler = torch.amp.GradScaler("cuda")\r\n'


def test_an_inserted_line_takes_its_neighbours_line_break_in_a_mixed_file(cli, tmp_path):
    # a file whose header has CRLF and whose body LF got its inserted unscale_ with CRLF
    path = tmp_path / "mixed.py"
    path.write_bytes(b"import torch\r\n\r\ndef f(scaler, opt, loss, model):\n    scaler.scale(loss).backward()\n"
                     b"    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n    scaler.step(opt)\n"
                     b"    scaler.update()\n")
    cli("check", path, "--lint-only", "--fix", "--unsafe-fixes")
    assert path.read_bytes().count(b"\r") == 2
    assert b"    scaler.scale(loss).backward()\n    scaler.unscale_(opt)\n    torch.nn" in path.read_bytes()


def _tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text(
        "import torch\n\ndef f(loss):\n    with torch.autocast('cuda'):\n        pass\n    loss.backward()\n")
    (tmp_path / "pkg" / "broken.py").write_text("def f(:\n    pass\n")
    for skipped in (".venv/lib", "build", ".git", "env_custom/lib"):
        (tmp_path / skipped).mkdir(parents=True)
        (tmp_path / skipped / "x.py").write_text("from torch.cuda.amp import autocast\n")
    (tmp_path / "env_custom" / "pyvenv.cfg").write_text("home = /usr\n")  # a venv by its marker
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "old.py").write_text("from torch.cuda.amp import autocast\n")
    return tmp_path


def test_folder_walk_skips_environments_and_reports_everything_at_once(cli, tmp_path):
    root = _tree(tmp_path)
    files = python_files(root)
    assert sorted(p.relative_to(root).as_posix() for p in files) == ["pkg/broken.py", "pkg/train.py",
                                                                      "scripts/old.py"]
    doc = cli("check", root, "--format", "json").json()
    found = sorted((Path(f["file"]).name, f["rule"], f["line"]) for f in doc["findings"])
    assert found == [("broken.py", "AMP004", 1), ("old.py", "AMP401", 1), ("train.py", "AMP403", 4)]
    assert doc["target"]["notes"][0] == "linted 3 Python files"
    doc = cli("check", root, "--exclude", "scripts", "--format", "json").json()
    assert sorted(Path(f["file"]).name for f in doc["findings"]) == ["broken.py", "train.py"]


def test_many_files_are_linted_in_parallel_with_the_same_result(tmp_path):
    source = (RULE_FIXTURES / "AMP406_invalid.py").read_text()
    for i in range(30):
        (tmp_path / f"s{i:02d}.py").write_text(source)
    serial = check_targets([str(tmp_path)], Config(), CheckOptions(jobs=1))
    parallel = check_targets([str(tmp_path)], Config(), CheckOptions(jobs=2))
    assert serial.findings == parallel.findings and len(serial.findings) == 30 * source.count("# expect: AMP406")


def test_precommit_hook_definition_and_entry():
    yaml = pytest.importorskip("yaml")
    (hook,) = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert hook["id"] == "ampaudit" and hook["language"] == "python" and hook["types"] == ["python"]
    assert hook["entry"] == "ampaudit check --lint-only"
    # pre-commit appends the staged files to the entry: it must take several and never import them.
    entry = [sys.executable, "-m", "ampaudit", *hook["entry"].split()[1:]]
    files = ["fixtures/scripts/clean_amp_loop.py", "fixtures/scripts/clean_bf16_loop.py",
             "fixtures/models/train_script.py"]
    proc = subprocess.run([*entry, *files], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr  # train_script.py: AMP409
    assert "AMP409" in proc.stdout and "Traceback" not in proc.stderr
    proc = subprocess.run([*entry, *files[:2]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0


def test_lint_only_never_imports_torch():
    code = ("import sys; from ampaudit.cli.main import main\n"
            "code = main(['check', '--lint-only', '--format', 'json', 'fixtures/scripts/clean_amp_loop.py'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "raise SystemExit(code)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _all_fixture_files():
    return sorted((ROOT / "fixtures").rglob("*.py"))


def test_skipping_irrelevant_code_changes_no_finding(monkeypatch):
    # relevant_statements() drops functions and classes that mention nothing the rules read;
    # the findings - their messages and fixes too - must be exactly those of a full visit,
    # on every fixture we have (aliases.py: a function that names an old AMP API only by
    # its alias).
    from ampaudit.check.lint import collect

    def lint_all():
        out = {}
        for path in _all_fixture_files():
            try:
                out[path.name] = [(f.line, f.rule, f.message, f.autofix)
                                  for f in lint_source(str(path), path.read_text())]
            except Exception as exc:  # the syntax-error fixtures
                out[path.name] = type(exc).__name__
        return out

    fast = lint_all()
    monkeypatch.setattr(collect, "relevant_statements", lambda text, tree, relevant: tree.body)
    assert lint_all() == fast
    assert sum(len(v) for v in fast.values() if isinstance(v, list)) > 35


def test_progress_is_reported_per_file(tmp_path):
    for i in range(25):
        (tmp_path / f"s{i:02d}.py").write_text("import torch\n")
    ticks = []
    check_targets([str(tmp_path)], Config(), CheckOptions(jobs=1, progress=lambda total: lambda: ticks.append(total)))
    assert ticks == [25] * 25


def test_a_new_rule_is_heard_inside_functions_it_declares_it_reads(monkeypatch):
    # The lint skips top-level functions that mention nothing any rule reads. A rule keyed
    # on a new API declares its words with the rule and fires inside such a function - no
    # second list to update.
    from ampaudit.check.lint.protocol import finding
    from ampaudit.check.script_rules import LINT_RULES, lint_rule

    LINT_RULES.load()
    monkeypatch.setattr(LINT_RULES, "by_code", dict(LINT_RULES.by_code))
    monkeypatch.setattr(LINT_RULES, "reads", dict(LINT_RULES.reads))
    monkeypatch.setattr(LINT_RULES, "_pattern", None)
    source = "def train(model):\n    model.frobnicate()\n"
    assert lint_source("t.py", source) == []

    @lint_rule("AMP499", reads=(r"\.frobnicate\(",))
    def frobnicate(facts):
        for call in facts.calls:
            if call.method == "frobnicate":
                yield finding(facts, "AMP402", call, use="frobnicate()", fix="none")

    found = lint_source("t.py", source)
    assert [(f.rule, f.line) for f in found] == [("AMP402", 2)]
    monkeypatch.setattr(LINT_RULES, "_pattern", None)  # the registry's cache is rebuilt without it afterwards



def _immutable(value, seen=None):
    """Whether ``value`` and everything it holds - tuples, frozensets, read-only mappings,
    frozen records - cannot be changed (syntax tree nodes are the parse's, not facts)."""
    import ast
    import dataclasses
    from types import MappingProxyType

    if isinstance(value, (str, int, float, bool, type(None), ast.AST)):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(_immutable(v) for v in value)
    if isinstance(value, MappingProxyType):
        return all(_immutable(k) and _immutable(v) for k, v in value.items())
    if dataclasses.is_dataclass(value):
        return type(value).__dataclass_params__.frozen and all(
            _immutable(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def test_facts_are_read_only_after_the_visit(monkeypatch):
    # Every rule reads the same ScriptFacts: none can change what the next one reads. A helper
    # that derives something several rules ask memoizes it outside the facts (memo.per_file).
    import dataclasses

    from ampaudit.check.lint.collect import collect
    from ampaudit.check.script_rules import LINT_RULES, lint_rule

    path = ROOT / "fixtures" / "trainers" / "13_gan_two_scalers_bug.py"
    facts = collect(str(path), path.read_text())
    assert facts.calls and facts.assignments and facts.autocasts and facts.scopes()
    for field in dataclasses.fields(facts):
        assert _immutable(getattr(facts, field.name)), field.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.calls = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.cache = {}  # no new attribute either
    with pytest.raises(AttributeError):
        facts.calls[0].line = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.autocasts[0].enabled = False
    with pytest.raises(AttributeError):
        facts.calls.append(facts.calls[0])
    with pytest.raises(TypeError):
        facts.scalers_by_scope[facts.module_scope] = frozenset()

    # and through the lint: a rule that writes into the facts fails
    LINT_RULES.load()
    monkeypatch.setattr(LINT_RULES, "by_code", dict(LINT_RULES.by_code))
    monkeypatch.setattr(LINT_RULES, "reads", dict(LINT_RULES.reads))
    monkeypatch.setattr(LINT_RULES, "_pattern", None)

    @lint_rule("AMP499", reads=("backward",))
    def caching(facts):
        facts.seen = [c for c in facts.calls if c.method == "backward"]
        yield from ()

    with pytest.raises(dataclasses.FrozenInstanceError):
        lint_source(str(path), path.read_text())
    monkeypatch.setattr(LINT_RULES, "_pattern", None)  # the registry's cache is rebuilt without it afterwards


def test_a_helper_memoizes_per_file_and_forgets_with_the_facts():
    import gc
    import weakref

    from ampaudit.check.lint.collect import collect
    from ampaudit.check.lint.memo import per_file

    asked = []

    @per_file
    def calls_named(facts, name):
        asked.append(name)
        return tuple(c for c in facts.calls if c.method == name)

    facts, other = collect("a.py", "x.step()\nx.step()\n"), collect("b.py", "x.step()\n")
    assert len(calls_named(facts, "step")) == 2 and calls_named(facts, "step") is calls_named(facts, "step")
    assert len(calls_named(other, "step")) == 1 and asked == ["step", "step"]  # once per file
    gone = weakref.ref(facts)
    del facts
    gc.collect()
    assert gone() is None  # the memo does not keep a file's facts alive


def test_a_rule_reads_the_same_facts_whatever_ran_before():
    # AMP416 asks whether the file uses fp16 at all: a fact of the visit (any torch.float16 /
    # torch.half in the code), not of which names other rules happened to look up first.
    from ampaudit.check.lint.collect import collect
    from ampaudit.check.script_rules.one_plus_tiny import one_plus_tiny

    source = "import torch\nx = torch.zeros(3, dtype=torch.float16)\ny = 1 - 1e-5\n"
    assert [f.rule for f in one_plus_tiny(collect("t.py", source))] == ["AMP416"]
    assert [f.rule for f in lint_source("t.py", source)] == ["AMP416"]
    aliased = "from torch import half\nx = torch.zeros(3, dtype=half)\ny = 1 - 1e-5\n"
    assert [f.rule for f in lint_source("t.py", aliased)] == ["AMP416"]
    assert lint_source("t.py", "import torch\nx = torch.zeros(3)\ny = 1 - 1e-5\n") == []

def test_a_lint_rule_must_say_what_it_reads():
    from ampaudit.check.script_rules import lint_rule

    with pytest.raises(ValueError, match="AMP498 must declare the source text it reads"):
        lint_rule("AMP498", reads=())


def test_every_lint_rule_declares_patterns_that_compile():
    import re

    from ampaudit.check.script_rules import LINT_RULES

    LINT_RULES.load()
    for fn, words in LINT_RULES.reads.items():
        assert words, fn.__name__
        for word in words:
            re.compile(word)


def test_fp32_region_input_of_unknown_dtype_may_promote_a_loss():
    # RVC's train.py: the mel is a slice of a function's result (unknown), the prediction
    # .half()-ed; F.l1_loss(fp32, fp16) computes in fp32, so an unknown input is no finding -
    # while a non-tensor keyword (reduction=) or a Python number leaves a low input low.
    source = (
        "import torch\nimport torch.nn.functional as F\nfrom mel import spec_to_mel, slice_segments\n\n\n"
        "def step(net_g, x, spec, ids, reduction):\n"
        "    with torch.autocast('cuda'):\n"
        "        y_hat = net_g(x)\n"
        "        y_mel = slice_segments(spec_to_mel(spec), ids, 32)\n"
        "        y_hat_mel = y_hat.float().half()\n"
        "        with torch.autocast('cuda', enabled=False):\n"
        "            a = F.l1_loss(y_mel, y_hat_mel)\n"
        "            b = F.mse_loss(y_hat_mel, target=y_mel)\n"
        "            c = F.mse_loss(y_hat_mel, y_hat, reduction=reduction)\n"
        "            d = torch.add(y_hat_mel, -1.0)\n"
        "            e = F.cross_entropy(y_hat, ids)\n"
        "    return a + b + c + d + e\n"
    )
    assert [(f.line, f.rule) for f in lint_source("t.py", source) if f.rule == "AMP422"] == [
        (14, "AMP422"), (15, "AMP422"), (16, "AMP422")]


def test_autograd_function_of_collectives_needs_no_custom_fwd():
    # VICReg's FullGatherLayer (zeros_like, all_gather, stack, all_reduce) keeps its input's
    # dtype forward and back: no AMP415; the same file's matmul Function still gets one.
    source = (
        "import torch\nimport torch.distributed as dist\n\n\n"
        "class FullGatherLayer(torch.autograd.Function):\n"
        "    @staticmethod\n"
        "    def forward(ctx, x):\n"
        "        output = [torch.zeros_like(x) for _ in range(dist.get_world_size())]\n"
        "        dist.all_gather(output, x)\n"
        "        return tuple(output)\n\n"
        "    @staticmethod\n"
        "    def backward(ctx, *grads):\n"
        "        all_gradients = torch.stack(grads)\n"
        "        dist.all_reduce(all_gradients)\n"
        "        return all_gradients[dist.get_rank()]\n\n\n"
        "class Project(torch.autograd.Function):\n"
        "    @staticmethod\n"
        "    def forward(ctx, x, w):\n"
        "        ctx.save_for_backward(x, w)\n"
        "        return torch.matmul(x, w)\n\n"
        "    @staticmethod\n"
        "    def backward(ctx, g):\n"
        "        x, w = ctx.saved_tensors\n"
        "        return g, g\n\n\n"
        "def step(model, x):\n"
        "    with torch.autocast('cuda'):\n"
        "        return torch.cat(FullGatherLayer.apply(model(x)), dim=0)\n"
    )
    assert [(f.line, f.rule) for f in lint_source("t.py", source) if f.rule == "AMP415"] == [(19, "AMP415")]


def test_autocast_held_in_another_functions_local_is_not_this_ones():
    # apple/ml-fastvit train.py (timm's shape): main() holds torch.cuda.amp.autocast in
    # `amp_autocast` on the runs that also build a scaler; train_one_epoch's parameter of the
    # same name defaults to contextlib.suppress - it is not main()'s local, so no AMP403 there.
    source = (
        "from contextlib import suppress\n\nimport torch\nfrom timm.utils import NativeScaler\n\n\n"
        "def main(args, model, loader, optimizer):\n"
        "    amp_autocast = suppress\n"
        "    loss_scaler = None\n"
        "    if args.amp:\n"
        "        amp_autocast = torch.cuda.amp.autocast\n"
        "        loss_scaler = NativeScaler()\n"
        "    train_one_epoch(model, loader, optimizer, amp_autocast=amp_autocast, loss_scaler=loss_scaler)\n\n\n"
        "def train_one_epoch(model, loader, optimizer, amp_autocast=suppress, loss_scaler=None):\n"
        "    for x, y in loader:\n"
        "        with amp_autocast():\n"
        "            loss = model(x, y)\n"
        "        if loss_scaler is not None:\n"
        "            loss_scaler(loss, optimizer)\n"
        "        else:\n"
        "            loss.backward()\n"
        "            optimizer.step()\n\n\n"
        "def own_context(model, x, y, optimizer):\n"
        "    amp_autocast = torch.autocast('cuda')\n"
        "    with amp_autocast:\n"
        "        loss = model(x, y)\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
    )
    assert [(f.line, f.rule) for f in lint_source("t.py", source) if f.rule == "AMP403"] == [(29, "AMP403")]
