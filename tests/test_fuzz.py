"""Fuzzing the training-script lint and its autofixer (hypothesis + hypothesmith).

Properties, over arbitrary valid Python (hypothesmith) and over generated training scripts
that compose the shapes the lint knows (so that its fixes really trigger):

1. the lint never crashes: ``lint_source`` returns findings or raises the documented
   ``SyntaxError``; ``lint_file(..., syntax_errors_as_findings=True)`` never raises,
   whatever the bytes (odd encodings, BOMs, null bytes), and reports AMP004 when Python
   itself refuses the file;
2. ``--fix`` output compiles whenever the input did;
3. a second ``--fix`` changes nothing (safe fixes, and with ``--unsafe-fixes``);
4. the ``--diff`` printed, applied to the original by a strict patch reader (lines end at
   ``\\n`` only, as GNU patch reads them), gives exactly what ``--fix`` writes.

Every run tests the same examples (``derandomize=True``, no example database), so CI is
deterministic; the whole file takes well under a minute on two cores.
"""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")
hypothesmith = pytest.importorskip("hypothesmith")

from hypothesis import HealthCheck, Phase, example, given, reject, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ampaudit.check.fix import fix_files  # noqa: E402
from ampaudit.check.lint_file import lint_file, lint_source  # noqa: E402
from ampaudit.cli.main import main  # noqa: E402
from ampaudit.core.python_source import read_python  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::SyntaxWarning", "ignore::DeprecationWarning")

FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
EXPLICIT = settings(FUZZ, phases=[Phase.explicit])  # only the @example reproducers


def _scaled(ci_examples: int) -> int:
    """The count CI runs, scaled by the loaded profile (tests/conftest.py: "ci" 100, "quick" 10)."""
    return max(1, ci_examples * settings.default.max_examples // 100)

# Codes whose findings carry an automatic fix (AMP401 safe, the others unsafe).
FIXABLE = frozenset({"AMP401", "AMP405", "AMP406", "AMP407", "AMP414", "AMP418", "AMP423", "AMP424"})


# --------------------------------------------------------------------------- helpers


def _cli(*args: str) -> tuple[int, str, str]:
    """``ampaudit check --lint-only ARGS`` in-process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["check", "--lint-only", "--fail-on", "never", *args])
    return code, out.getvalue(), err.getvalue()


def _compiles(raw: bytes) -> bool:
    """Python accepts the file (bytes: its coding cookie and BOM are honoured)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            compile(raw, "<fuzz>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError, UnicodeDecodeError, LookupError, MemoryError, RecursionError):
            return False
    return True


def _lines(text: str) -> list[str]:
    """Lines as patch reads them: each ends at "\\n" (kept), and only there."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


_HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def apply_unified_diff(original: str, diff: str) -> str:
    """Apply a one-file unified diff strictly: every context and removed line must match the
    original exactly, hunk sizes must match their headers, and ``\\ No newline at end of file``
    takes the newline off the line before it (as GNU patch does)."""
    source = _lines(original)
    rows = _lines(diff)
    if not rows:
        return original
    assert rows[0].startswith("--- ") and rows[1].startswith("+++ "), f"no file header: {rows[:2]!r}"
    out: list[str] = []
    cursor = 0
    i = 2
    while i < len(rows):
        match = _HUNK.match(rows[i])
        assert match, f"not a hunk header: {rows[i]!r}"
        old_start, old_count = int(match[1]), int(match[2] or 1)
        new_count = int(match[4] or 1)
        i += 1
        old: list[str] = []
        new: list[str] = []
        last: list[list[str]] = []
        while i < len(rows) and not rows[i].startswith("@@"):
            row = rows[i]
            i += 1
            tag, body = row[:1], row[1:]
            if tag == "\\":
                assert last, "a no-newline marker with no line before it"
                for side in last:
                    assert side[-1].endswith("\n"), "two no-newline markers on one line"
                    side[-1] = side[-1][:-1]
                continue
            assert tag in (" ", "-", "+"), f"not a diff line: {row!r}"
            last = [s for s, wanted in ((old, " -"), (new, " +")) if tag in wanted]
            for side in last:
                side.append(body)
        assert (len(old), len(new)) == (old_count, new_count), f"hunk sizes differ from the header {match[0]}"
        start = old_start - 1 if old_count else old_start
        assert start >= cursor, "hunks out of order"
        assert source[start:start + len(old)] == old, f"hunk {match[0]} does not match the original"
        out += source[cursor:start] + new
        cursor = start + len(old)
    return "".join(out + source[cursor:])


def _text(raw: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.py"
        path.write_bytes(raw)
        return read_python(path)[0]


def check_fix_roundtrip(raw: bytes, *, unsafe: bool, must_lint: bool = True) -> None:
    """Properties 2-4 through the CLI. ``must_lint=False``: a file Python cannot parse may
    be refused with a one-line error (exit 2)."""
    flags = ["--unsafe-fixes"] if unsafe else []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.py"
        path.write_bytes(raw)
        code, diff, err = _cli("--diff", *flags, str(path))
        if code == 2 and not must_lint and err.startswith("ampaudit: error: syntax error in "):
            assert "unexpected" not in err and err.count("\n") == 1, err
            return
        assert code in (0, 1) and "ampaudit: error" not in err, err
        assert path.read_bytes() == raw, "--diff wrote the file"
        code, _, err = _cli("--fix", *flags, "--format", "json", str(path))
        assert code in (0, 1) and "ampaudit: error" not in err, err
        fixed_raw = path.read_bytes()
        original, fixed = _text(raw), _text(fixed_raw)
        # 4. --diff is exactly what --fix does
        assert (diff == "") == (fixed_raw == raw)
        assert apply_unified_diff(original, diff) == fixed, f"--diff differs from --fix:\n{diff}"
        # 2. the fix keeps the file valid Python, in its encoding (a BOM stays), its line endings too
        assert fixed_raw.startswith(b"\xef\xbb\xbf") == raw.startswith(b"\xef\xbb\xbf")
        assert b"\r\r\n" not in fixed_raw or b"\r\r\n" in raw
        if _compiles(raw):
            assert _compiles(fixed_raw), f"--fix broke the file:\n{fixed}"
        # 3. idempotent
        code, _, err = _cli("--fix", *flags, "--format", "json", str(path))
        assert code in (0, 1) and "ampaudit: error" not in err, err
        again = path.read_bytes()
        assert again == fixed_raw, f"a second --fix changed the file:\n{fixed}\n---- to ----\n{_text(again)}"


def _fixes(raw: bytes, *, unsafe: bool) -> list:
    """The findings the fixer would fix (API level, nothing written)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.py"
        path.write_bytes(raw)
        return [f for r in fix_files(lint_file(path), unsafe=unsafe, write=False) for f in r.fixed]


# --------------------------------------------------------------------------- training-script shapes


@dataclass
class Block:
    header: str
    body: list


_NAMES = {
    "scaler": ("scaler", "grad_scaler", "amp_scaler", "scaler", "échelle", "スケーラ"),
    "optimizer": ("optimizer", "opt", "optimizer", "optimiseur", "оптимизатор"),
    "model": ("model", "net", "model", "模型"),
    "loss": ("loss", "total_loss", "loss", "perte", "λoss"),
}
_COMMENTS = ("step the optimizer", "TODO: warmup", "mixed precision", "fp16 here", "schritt für schritt ✓",
             "scaler.update()  # not code", "noqa", "type: ignore")
_STRINGS = ("done", "étape", "损失", "ok ✓", "a 'quoted' word", "tab\\tescaped")


class _Imports:
    def __init__(self) -> None:
        self.lines = ["import torch", "import torch.nn.functional as F", "from torch import nn"]
        self.old: list[str] = []  # from torch.cuda.amp import ...
        self.new: list[str] = []  # from torch.amp import ...
        self.extra: list[str] = []

    def need(self, bucket: list[str], name: str) -> None:
        if name not in bucket:
            bucket.append(name)

    def render(self, draw) -> list[str]:
        lines = list(self.lines)
        if self.old:
            names = sorted(self.old, key=str.lower) if draw(st.booleans()) else self.old
            lines.append(f"from torch.cuda.amp import {', '.join(names)}")
        if self.new:
            lines.append(f"from torch.amp import {', '.join(self.new)}")
        return lines + self.extra


@st.composite
def training_scripts(draw) -> bytes:
    """A training script as file bytes, composed from the shapes the lint knows: old and new amp
    imports (names, module aliases, spelled out), a GradScaler built inline, at module level, in
    a helper, as a parameter, on ``self`` or ``... if use_amp else None``; autocast direct or bound
    to ``ctx``; scaled or raw backward, with ``if use_amp:`` / ``else:`` branches; unscale_/clip in
    either order, ``scaler.step`` or ``optimizer.step``, zero to two ``update()``; gradient
    accumulation; functions, classes, a module-level loop; custom_fwd/custom_bwd, mask constants,
    accelerate and Lightning. Comments, blank lines, form feeds, one-line compound statements,
    multi-line calls, non-ASCII names and strings; one indentation unit (tabs or spaces) and one
    newline style (CRLF sometimes) per script; no final newline, a BOM or a latin-1 cookie
    sometimes."""
    unit = draw(st.sampled_from(["    ", "    ", "  ", "\t"]))
    newline = draw(st.sampled_from(["\n", "\n", "\n", "\r\n"]))
    names = {role: draw(st.sampled_from(options)) for role, options in _NAMES.items()}
    M, OPT, L = names["model"], names["optimizer"], names["loss"]
    imports = _Imports()

    scaler_api = draw(st.sampled_from(["old_names", "old_full", "old_alias", "new_full", "new_names",
                                       "new_module", "none"]))
    autocast_api = draw(st.sampled_from(["old_names", "old_full", "old_alias", "old_cpu", "torch", "new_full",
                                         "new_names", "new_module"]))
    new_module = "new_module" in (scaler_api, autocast_api)
    old_alias = "amp" if not new_module else "cuda_amp"
    if "old_alias" in (scaler_api, autocast_api):
        if draw(st.booleans()):
            imports.extra.append(f"from torch.cuda import amp{'' if old_alias == 'amp' else ' as cuda_amp'}")
        else:
            imports.extra.append(f"import torch.cuda.amp as {old_alias}")
    if new_module:
        imports.extra.append("from torch import amp")

    def call(api: str, name: str, args: list[str], device: str = '"cuda"') -> str:
        if api == "old_names":
            imports.need(imports.old, name)
            return f"{name}({', '.join(args)})"
        if api == "old_full":
            return f"torch.cuda.amp.{name}({', '.join(args)})"
        if api == "old_cpu":
            return f"torch.cpu.amp.{name}({', '.join(args)})"
        if api == "old_alias":
            return f"{old_alias}.{name}({', '.join(args)})"
        if api == "torch":
            first = device if draw(st.booleans()) else f"device_type={device}"
            return f"torch.{name}({', '.join([first, *args])})"
        prefix = {"new_full": "torch.amp.", "new_names": "", "new_module": "amp."}[api]
        if api == "new_names":
            imports.need(imports.new, name)
        return f"{prefix}{name}({', '.join([device, *args])})"

    # ---- the scaler
    scaler_where = draw(st.sampled_from(["local", "local", "global", "helper", "param", "attr", "optional"]))
    in_class = scaler_where == "attr" or draw(st.integers(0, 5)) == 0
    S = ("self." if scaler_where == "attr" else "") + names["scaler"]
    scaler_kwargs = draw(st.sampled_from([[], [], ["enabled=use_amp"], ["init_scale=2.0**12"],
                                          ["enabled=use_amp", "growth_interval=100"]]))
    scaler_expr = call(scaler_api, "GradScaler", scaler_kwargs) if scaler_api != "none" else None
    if scaler_where == "optional" and scaler_expr:
        scaler_expr = f"{scaler_expr} if use_amp else None"
    guarded = scaler_where == "optional" and draw(st.booleans())

    # ---- autocast
    dtype = draw(st.sampled_from([None, "torch.float16", "torch.float16", "torch.bfloat16", "amp_dtype"]))
    ac_args = [f"dtype={dtype}"] if dtype else []
    if draw(st.booleans()):
        ac_args.append("enabled=use_amp")
    autocast = call(autocast_api, "autocast", ac_args, '"cpu"' if autocast_api == "old_cpu" else '"cuda"')
    bound = draw(st.sampled_from(["direct", "direct", "ctx", "ctx_nullcontext"]))
    setup: list = []
    if bound == "ctx":
        setup.append(f"ctx = {autocast}")
        autocast = "ctx"
    elif bound == "ctx_nullcontext":
        imports.need(imports.extra, "import contextlib")
        setup.append(f"ctx = {autocast} if use_amp else contextlib.nullcontext()")
        autocast = "ctx"

    # ---- the step: backward, unscale/clip, step, update
    def clip() -> str:
        return draw(st.sampled_from([
            f"torch.nn.utils.clip_grad_norm_({M}.parameters(), 1.0)",
            f"torch.nn.utils.clip_grad_norm_({M}.parameters(), max_norm=1.0)",
            f"nn.utils.clip_grad_value_({M}.parameters(), 0.5)",
            f"grad_norm = torch.nn.utils.clip_grad_norm_(\n{M}.parameters(),\n1.0,\n)",
        ]))

    def amp_tail() -> list:
        order = draw(st.sampled_from(["", "", "clip", "unscale clip", "clip unscale", "unscale",
                                      "unscale unscale clip"]))
        stmts: list = [clip() if w == "clip" else f"{S}.unscale_({OPT})" for w in order.split()]
        if draw(st.integers(0, 3)) == 0:
            stmts.append(f"{OPT}.step()")
        else:
            stmts.append(draw(st.sampled_from([f"{S}.step({OPT})", f"{S}.step({OPT})", f"{S}.step(\n{OPT}\n)"])))
        stmts += [f"{S}.update()"] * draw(st.sampled_from([1, 1, 1, 0, 2]))
        if guarded:
            scaler_part = [s for s in stmts if s.startswith(S)]
            if scaler_part and draw(st.booleans()):
                stmts = [Block(f"if {S} is not None:", [s]) if s.startswith(S) else s for s in stmts]
        if len(stmts) >= 2 and draw(st.integers(0, 5)) == 0:  # two statements on one line
            a, b = stmts[-2], stmts[-1]
            if isinstance(a, str) and isinstance(b, str) and "\n" not in a + b:
                stmts[-2:] = [f"{a}; {b}"]
        return stmts

    scaled = f"{S}.scale({L}).backward()"
    raw_backward = f"{L}.backward()"
    branch = draw(st.sampled_from(["amp", "amp", "raw", "if_else", "if_else_backward", "one_line"]))
    accumulate = draw(st.integers(0, 3)) == 0
    zero_grad = f"{OPT}.zero_grad(set_to_none=True)"
    if branch == "amp":
        backward, tail = [scaled], amp_tail()
    elif branch == "raw":
        backward, tail = [raw_backward], amp_tail()
    elif branch == "if_else_backward":
        backward, tail = [Block("if use_amp:", [scaled]), Block("else:", [raw_backward])], amp_tail()
    elif branch == "one_line":  # compound statements on one line
        backward, tail = [f"if use_amp: {scaled}", f"else: {raw_backward}"], amp_tail()
    else:
        fp32 = ([clip()] if draw(st.booleans()) else []) + [f"{OPT}.step()"]
        backward, tail = [Block("if use_amp:", [scaled, *amp_tail()]), Block("else:", [raw_backward, *fp32])], []
    if accumulate:
        step_part = [Block("if (i + 1) % accum_steps == 0:", [*tail, zero_grad])] if tail else []
        if not tail:  # the if/else holds the step: accumulate around it
            backward = [Block("if (i + 1) % accum_steps == 0:", backward), Block("else:", [scaled])]
    else:
        step_part = tail
    forward = [f"out = {M}(x)", f"{L} = F.cross_entropy(out, y)"]
    if accumulate:
        forward.append(f"{L} = {L} / accum_steps")
    body: list = []
    if not accumulate and draw(st.booleans()):
        body.append(zero_grad)
    body += [Block(f"with {autocast}:", forward), *backward, *step_part]
    if draw(st.integers(0, 2)) == 0:
        body.append(f'print(f"{draw(st.sampled_from(_STRINGS))} {{i}}: {{{L}.item():.4f}}")')
    loop = Block(draw(st.sampled_from(["for i, (x, y) in enumerate(loader):", "for i, (x, y) in enumerate(loader):",
                                       "for i, batch in enumerate(loader):"])), body)
    if loop.header.endswith("batch in enumerate(loader):"):
        body.insert(0, "x, y = batch")

    # ---- where it all lives
    module: list = []
    if scaler_where == "global" and scaler_expr:
        module.append(f"{S} = {scaler_expr}")
    if dtype == "amp_dtype":
        module.insert(0, "amp_dtype = torch.float16")
    params = [M, "loader"]
    prelude: list = []
    if scaler_where == "param":
        params.append(names["scaler"])
    if draw(st.booleans()):
        params.append(OPT)
    else:
        prelude.append(f"{OPT} = torch.optim.{draw(st.sampled_from(['AdamW', 'SGD', 'Adam']))}({M}.parameters(), "
                       f"lr=1e-3)")
    params.append("use_amp=True")
    if accumulate:
        params.append("accum_steps=4")
    if scaler_expr and scaler_where in ("local", "optional"):
        prelude.append(f"{S} = {scaler_expr}")
    if scaler_expr and scaler_where == "helper":
        module.append(Block("def build_scaler(use_amp):", [f"return {scaler_expr}"]))
        prelude.append(f"{S} = build_scaler(use_amp)")
    if scaler_where == "attr" and scaler_expr:
        # S is self.<name>: the class builds it
        init = Block("def __init__(self, use_amp=True):", [f"{S} = {scaler_expr}"])
        method = Block(f"def train_epoch(self, {', '.join(params)}):", [*prelude, *setup, loop])
        module.append(Block("class Trainer:", [init, method]))
    elif in_class:
        method = Block(f"def train_epoch(self, {', '.join(params)}):", [*prelude, *setup, loop])
        module.append(Block("class Trainer:", ['"""Runs the epochs."""', method]))
    elif draw(st.integers(0, 4)) == 0:  # a script: the loop at module level
        module += [*setup, "use_amp = True", "accum_steps = 4", f"{M} = nn.Linear(8, 2)", "loader = []", *prelude, loop]
        if scaler_where == "param" and scaler_expr:
            module.insert(len(module) - 1, f"{S} = {scaler_expr}")
    else:
        module.append(Block(f"def train({', '.join(params)}):", [*prelude, *setup, loop]))
    if scaler_where == "param" and scaler_expr and not any(f"{S} = {scaler_expr}" == m for m in module):
        module.append(Block("def main():", [f"{S} = {scaler_expr}", f"return {S}"]))

    # ---- extras: custom_fwd, mask constants, frameworks
    if draw(st.integers(0, 2)) == 0:
        fwd_api = draw(st.sampled_from(["old_full", "old_names", "new_full", "new_names", "new_device"]))
        deco = []
        for fn in ("custom_fwd", "custom_bwd"):
            arg = "(cast_inputs=torch.float32)" if fn == "custom_fwd" and draw(st.booleans()) else ""
            if fwd_api == "old_full":
                deco.append(f"torch.cuda.amp.{fn}{arg}")
            elif fwd_api == "old_names":
                imports.need(imports.old, fn)
                deco.append(f"{fn}{arg}")
            elif fwd_api == "new_names":
                imports.need(imports.new, fn)
                deco.append(f"{fn}{arg}")
            elif fwd_api == "new_device":
                deco.append(f'torch.amp.{fn}(device_type="cuda"{", cast_inputs=torch.float32" if arg else ""})')
            else:
                deco.append(f"torch.amp.{fn}{arg}")
        module.append(Block("class ScaledMatmul(torch.autograd.Function):", [
            "@staticmethod", f"@{deco[0]}",
            Block("def forward(ctx, a, b):", ["ctx.save_for_backward(a, b)", "return a @ b"]),
            "@staticmethod", f"@{deco[1]}",
            Block("def backward(ctx, grad):", ["a, b = ctx.saved_tensors", "return grad @ b.t(), a.t() @ grad"]),
        ]))
    if draw(st.integers(0, 2)) == 0:
        value = draw(st.sampled_from(["-1e9", "float('-inf')", "torch.finfo(torch.float32).min", "-1e4", "-100000.0",
                                      "torch.finfo(scores.dtype).min", "1e10", "-torch.finfo(torch.float).max"]))
        method = draw(st.sampled_from(["masked_fill", "masked_fill_"]))
        module.append(Block("def masked_scores(scores, mask):", [f"return scores.{method}(mask == 0, {value})"]))
    if draw(st.integers(0, 5)) == 0:
        imports.extra.append("from accelerate import Accelerator")
        module.append(Block(f"def accelerate_step(accelerator, {M}, {L}, {OPT}):", [
            f"accelerator.backward({L})", clip(), f"{OPT}.step()"]))
        module.append('accelerator = Accelerator(mixed_precision="fp16")')
    if draw(st.integers(0, 5)) == 0:
        imports.extra.append("import lightning as pl")
        module.append(Block("class LitNet(pl.LightningModule):", [
            Block("def training_step(self, batch, batch_idx):", [
                "x, y = batch", f"{L} = F.cross_entropy(self(x), y)", f"{L}.backward()", f"return {L}"])]))
    if draw(st.integers(0, 3)) == 0:
        module.append(Block('if __name__ == "__main__":', ["print(torch.__version__)"]))

    # ---- render: comments, blank lines, form feeds, one indentation unit, one newline style
    out: list[str] = []
    if draw(st.booleans()):
        out.append(f'"""A generated trainer ({draw(st.sampled_from(_STRINGS))})."""')
    out += imports.render(draw)

    form_feeds = draw(st.integers(0, 5)) == 0

    def render(items: list, depth: int) -> None:
        indent = unit * depth
        for item in items:
            roll = draw(st.integers(0, 15))
            if roll == 0:
                out.append(f"{indent}# {draw(st.sampled_from(_COMMENTS))}")
            elif roll == 1:
                out.append("")
            elif roll == 2 and depth == 0 and form_feeds:
                out.append("\x0c")  # a form feed: a page break, blank to Python
            trailing = f"  # {draw(st.sampled_from(_COMMENTS))}" if draw(st.integers(0, 9)) == 0 else ""
            if isinstance(item, Block):
                out.append(f"{indent}{item.header}{trailing}")
                render(item.body, depth + 1)
            else:
                first, *rest = item.split("\n")
                out.append(f"{indent}{first}" + ("" if rest else trailing))
                out.extend(f"{indent}{unit}{r}" if r != ")" else f"{indent}{r}" for r in rest)
            if depth == 0 and isinstance(item, Block):
                out.extend(["", ""])

    render(module, 0)
    while out and out[-1] == "":
        out.pop()
    text = newline.join(out) + (newline if draw(st.integers(0, 5)) else "")
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8", "bom", "latin-1"]))
    if encoding == "bom":
        return b"\xef\xbb\xbf" + text.encode("utf-8")
    if encoding == "latin-1":
        try:
            return f"# -*- coding: latin-1 -*-{newline}{text}".encode("latin-1")
        except UnicodeEncodeError:
            return f"# -*- coding: utf-8 -*-{newline}{text}".encode()
    return text.encode()


# --------------------------------------------------------------------------- 1. the lint never crashes


def _lint_source_or_syntax_error(source: str) -> None:
    try:
        findings = lint_source("fuzz.py", source)
    except SyntaxError:
        return  # documented: the caller reports it (AMP004 or exit 2)
    assert isinstance(findings, list)
    for f in findings:
        assert f.rule.startswith("AMP") and f.line >= 1


@settings(FUZZ, max_examples=_scaled(60))
@given(hypothesmith.from_grammar())
def test_lint_source_never_crashes_on_generated_python(source):
    _lint_source_or_syntax_error(source)


@settings(FUZZ, max_examples=_scaled(10))
@given(hypothesmith.from_node())
def test_lint_source_never_crashes_on_generated_syntax_trees(source):
    _lint_source_or_syntax_error(source)


_PREFIXES = (b"", b"\xef\xbb\xbf", b"# -*- coding: latin-1 -*-\n", b"# coding: utf-16\n", b"# coding: bogus\n",
             b"\xef\xbb\xbf# coding: latin-1\n", b"\x00", b"#!/usr/bin/env python\n# vim: set fileencoding=cp1252 :\n")
_ODD_TEXT = st.lists(st.sampled_from([*"ab (:)\t\n\r\x0c\x00\\'\"#é\u2028\ufeff", "def ", "if x:", "    "]),
                     max_size=30).map("".join)


@st.composite
def odd_files(draw) -> bytes:
    """Bytes Python may or may not accept: cookies, BOMs, nulls, broken UTF-8, cut-off scripts."""
    kind = draw(st.sampled_from(["bytes", "text", "script", "cut", "null"]))
    prefix = draw(st.sampled_from(_PREFIXES))
    if kind == "bytes":
        return prefix + draw(st.binary(max_size=64))
    if kind == "text":
        encoding = draw(st.sampled_from(["utf-8", "latin-1", "utf-16", "cp1252"]))
        return prefix + draw(_ODD_TEXT).encode(encoding, errors="replace")
    script = draw(training_scripts())
    if kind == "script":
        return prefix + script
    at = draw(st.integers(0, len(script)))
    return script[:at] + (b"\x00" if kind == "null" else b"") + script[at + (kind == "cut"):]


@settings(FUZZ, max_examples=_scaled(80))
@example(b"\xef\xbb\xbf# coding: latin-1\nx = 1\n")  # Python: "encoding problem: iso-8859-1 with BOM"
@example(b"# coding: bogus\nx = 1\n")  # Python: "unknown encoding: bogus"
@example(b"x = 1\x00\n")
@example(b"x = 1  # \x00\n")  # a null byte in a comment: Python refuses the file
@example(b"\xef\xbb\xbf\xef\xbb\xbfx = 1\n")  # two BOMs: Python drops only one, then refuses it
@example(b"def f():\n  x\n\x0c  y\n")  # a form feed in an indent: no exception either way
@given(odd_files())
def test_lint_file_never_raises_and_reports_what_python_refuses(raw):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "odd.py"
        path.write_bytes(raw)
        findings = lint_file(path, syntax_errors_as_findings=True)
    assert isinstance(findings, list)
    if not _compiles(raw):
        assert [f.rule for f in findings] == ["AMP004"], f"Python refuses {raw!r}, the lint said {findings}"


# --------------------------------------------------------------------------- 2-4. --fix and --diff


@settings(FUZZ, max_examples=_scaled(20))
@given(hypothesmith.from_grammar())
def test_fix_roundtrip_on_generated_python(source):
    try:
        raw = source.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate in a string literal: no file holds it
        reject()
    check_fix_roundtrip(raw, unsafe=True, must_lint=False)


@settings(FUZZ, max_examples=_scaled(100))
# the unified diff of fix.py once split lines where str.splitlines does (a form feed, U+2028)
# and ran a last line with no newline into the next one: `patch` read back something else
@example(b"import torch\nscaler = torch.cuda.amp.GradScaler()", False)
@example(b"def f(scaler, opt, loss):\n    scaler.scale(loss).backward()\n    scaler.step(opt)", True)
@example(b"import torch\nscaler = torch.cuda.amp.GradScaler()\n\x0c\ns = '\xe2\x80\xa8'\n", False)
@given(training_scripts(), st.booleans())
def test_fix_roundtrip_on_training_scripts(raw, unsafe):
    check_fix_roundtrip(raw, unsafe=unsafe)


def test_diff_marks_a_last_line_without_newline():
    from ampaudit.check.fix import unified_diff

    assert unified_diff("a\nb", "a\nc", "t.py") == (
        "--- a/t.py\n+++ b/t.py\n@@ -1,2 +1,2 @@\n a\n-b\n\\ No newline at end of file\n"
        "+c\n\\ No newline at end of file\n")
    assert unified_diff("\x0c\nx = 1\n", "\x0c\nx = 2\n", "t.py").endswith(" \x0c\n-x = 1\n+x = 2\n")


@pytest.mark.parametrize(("raw", "reason"), [
    (b"# coding: bogus\nx = 1\n", "has a coding cookie Python refuses (unknown encoding: bogus)"),
    (b"\xef\xbb\xbf# coding: latin-1\nx = 1\n", "has a UTF-8 BOM and a coding cookie for another encoding"),
    (b"x = 1\n# \x00\n", "has a null byte on line 2, which Python refuses"),
    (b"\xef\xbb\xbf\xef\xbb\xbfx = 1\n", "starts with two byte order marks, which Python refuses"),
    (b"x = '\xe9'\n", "is not utf-8 text"),
])
def test_a_file_python_refuses_before_parsing_is_not_linted(tmp_path, raw, reason):
    path = tmp_path / "cookie.py"
    path.write_bytes(raw)
    assert not _compiles(raw)
    assert [f.message for f in lint_file(path, syntax_errors_as_findings=True)] == [f"not linted: {reason}"]


# --------------------------------------------------------------------------- bugs this suite found


@pytest.mark.parametrize(("raw", "unsafe"), [
    # a CRLF file: the inserted scaler.update() goes after the CR and the LF, not between them
    (b"def f(scaler, opt, loss):\r\n    scaler.scale(loss).backward()\r\n    scaler.step(opt)\r\n", True),
    # a form feed (or \x0b, \x1c-\x1e, \x85, U+2028) is no line break for Python, nor for fix offsets
    (b"\x0c\nscaler = torch.cuda.amp.GradScaler()\n", False),
    ("# \u2028 \x85\nscaler = torch.cuda.amp.GradScaler()\n".encode(), False),
    # AMP405's fix (optimizer.step() -> scaler.step(optimizer)) also adds the missing update,
    # so a second --fix --unsafe-fixes has nothing left to do
    (b"def f(scaler, optimizer, loss):\n    scaler.scale(loss).backward()\n    optimizer.step()\n", True),
])
def test_fixes_found_by_fuzzing_round_trip(raw, unsafe):
    check_fix_roundtrip(raw, unsafe=unsafe)


def test_training_scripts_reach_the_fixes():
    """The generator is not vacuous: its scripts are valid Python, and most of them get fixes,
    of every fixable code."""
    seen: list[tuple[set[str], set[str]]] = []

    @settings(FUZZ, max_examples=60)  # a census of the generator: every profile needs all 60
    @given(training_scripts())
    def collect(raw):
        assert _compiles(raw), raw.decode("utf-8", "replace")
        safe = {f.rule for f in _fixes(raw, unsafe=False)}
        unsafe = {f.rule for f in _fixes(raw, unsafe=True)}
        seen.append((safe, unsafe))

    collect()
    total = len(seen)
    with_safe = sum(1 for safe, _ in seen if safe)
    with_unsafe = sum(1 for _, unsafe in seen if unsafe)
    codes = set().union(*(unsafe for _, unsafe in seen))
    print(f"{total} scripts: {with_safe} with safe fixes, {with_unsafe} with fixes under --unsafe-fixes; {codes}")
    assert total >= 50
    assert with_safe >= total * 0.4 and with_unsafe >= total * 0.6
    assert codes >= FIXABLE, f"never fixed: {sorted(FIXABLE - codes)}"
