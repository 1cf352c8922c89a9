"""AMP421 / AMP422 / AMP425: autocast regions that do not cover what they are meant to.

AMP421: a GradScaler scales a loss whose model forward runs outside every autocast region of
the function (only the loss is autocast): the model never runs in low precision.
AMP422: an ``autocast(enabled=False)`` region - the usual way to run a loss or a matcher in
fp32 - whose torch functions or loss modules take values computed under autocast (or
``.half()``-ed) without ``.float()``: disabling autocast does not cast its inputs, so the
region still computes in fp16.
AMP425: a script that builds a GradScaler and scales a loss its model forward computes, with no
autocast anywhere (Swin Transformer's main_simmim_ft.py, an `--enable-amp` flag no code reads):
the model trains in fp32.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator

from ampaudit.check.lint.facts import GRAD_SCALERS, Autocast, Call, Scope, ScriptFacts
from ampaudit.check.lint.inference import LOW, Inference, widest
from ampaudit.check.lint.nodes import Arg, arguments, dotted
from ampaudit.check.lint.protocol import amp_path, backward_scaler, finding, scaled_backward
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.catalog import builtin_catalog
from ampaudit.core.findings import Finding

# `model(x)`, `self.net(x)`, `model.forward(x)`: a call of something named like the model
_MODEL = re.compile(r"(^|\.)(model|net|network|backbone|generator|discriminator)s?(\.forward)?$", re.IGNORECASE)


@lint_rule("AMP421", reads=("autocast",))
def forward_outside_autocast(facts: ScriptFacts) -> Iterator[Finding]:
    enabled: dict[Scope, list[Autocast]] = {}
    for block in facts.autocasts:
        if block.enabled:
            enabled.setdefault(block.scope, []).append(block)
    for scope in facts.scopes():
        blocks = enabled.get(scope, [])
        scalers = facts.scalers(scope)
        backwards = [c for c in facts.calls_in(scope) if scaled_backward(facts, c, scalers)]
        if not blocks or not backwards:
            continue
        first_backward = min(c.line for c in backwards)
        models = [c for c in facts.calls_in(scope) if c.line < first_backward and amp_path(facts, c)
                  and _MODEL.search(dotted(c.node.func) or "") and not _constructor(c)]
        if models and all(c.autocast is None for c in models):
            call = models[0]
            yield finding(facts, "AMP421", call, model=facts.text(call.node.func), block_line=blocks[0].line,
                          fix=f"run {facts.text(call.node.func)}(...) inside the `with` autocast block")


# Text that says low precision may come from somewhere the lint does not follow: an autocast
# built or entered elsewhere (`amp_autocast`, a decorator), a cast, a precision flag a helper reads
_LOW_PRECISION_TEXT = re.compile(r"autocast|float16|bfloat16|half|fp16|bf16|precision", re.IGNORECASE)


@lint_rule("AMP425", reads=("GradScaler", r"\.scale\("))
def scaler_without_autocast(facts: ScriptFacts) -> Iterator[Finding]:
    if facts.autocasts or all(c.disabled for c in facts.calls_to(GRAD_SCALERS)):
        return  # no scaler built here (none, or enabled=False): it and the autocast may be elsewhere
    if _LOW_PRECISION_TEXT.search(_code(facts.source)):
        return
    withs: list[tuple[int, int]] | None = None
    for scope in facts.scopes():
        scalers = facts.scalers(scope)
        backwards = [(c, backward_scaler(facts, c, scalers)) for c in facts.calls_in(scope)]
        backwards = [(c, s) for c, s in backwards if s is not None]
        if not backwards:
            continue
        first, scaler = min(backwards, key=lambda b: b[0].line)
        models = [c for c in facts.calls_in(scope) if c.line < first.line
                  and _MODEL.search(dotted(c.node.func) or "") and not _constructor(c)]
        if not models:
            continue  # a scaler wrapper (NativeScaler(loss, optimizer)): the forward is the caller's
        if withs is None:
            withs = _with_spans(facts.source)
        # `with ctx:` around the forward may be an autocast made elsewhere
        models = [c for c in models if not any(start <= c.line <= end for start, end in withs)]
        if models:
            model = facts.text(models[0].node.func)
            yield finding(facts, "AMP425", models[0], model=model, scaler=scaler,
                          fix=f'run {model}(...) and the loss under `with torch.autocast("cuda"):`')


def _code(source: str) -> str:
    """The source without its comments and docstrings: prose about mixed precision is no cast."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    kept, previous = [], tokenize.NEWLINE
    for token in tokens:
        if token.type == tokenize.COMMENT:
            continue
        # a string that starts a statement (not one continuing a bracketed expression: NL)
        docstring = token.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
        if token.type not in (tokenize.NL, tokenize.COMMENT):
            previous = token.type
        if not docstring:
            kept.append(token.string)
    return " ".join(kept)


def _with_spans(source: str) -> list[tuple[int, int]]:
    """The lines of every ``with`` block's body in the file."""
    return [(node.body[0].lineno, node.end_lineno or node.lineno) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.With, ast.AsyncWith))]


@lint_rule("AMP422", reads=("autocast",))
def fp32_region_fed_low_precision(facts: ScriptFacts) -> Iterator[Finding]:
    # Only torch's own functions and loss modules: a function of the user's may cast its
    # inputs itself (VITS' losses do), which the lint cannot see from here.
    torch_modules = {a.target: next(n for n in a.call.names if n.startswith("torch.nn.")) for a in facts.assignments
                     if any(n.startswith("torch.nn.") for n in a.call.names)}
    for call in facts.calls:
        block = call.autocast
        if block is None or block.enabled or _is_cast(call):
            continue
        if not any(n.startswith("torch.") for n in call.names) and dotted(call.node.func) not in torch_modules:
            continue
        written = arguments(call.node)
        infer = _inference(facts, call.scope, block.line, torch_modules)
        dtypes = [infer.of(arg.value, autocast=False) for arg in written]
        if widest(dtypes) != LOW:
            continue  # no low input, or an fp32 one the op promotes to (F.l1_loss(fp32, fp16))
        if _may_promote(call, written, dtypes, torch_modules):
            continue  # F.l1_loss(y_mel, y_hat_mel.half()): an input of unknown dtype may be fp32
        arg = next(a for a, dtype in zip(written, dtypes, strict=True) if dtype == LOW)
        name = _root_name(arg.value) or facts.text(arg.value)
        line = facts.name_dtypes.get((id(call.scope), name), (LOW, call.line))[1]
        yield finding(facts, "AMP422", call, name=name, line_low=line,
                      fix=f"pass {facts.text(arg.value)}.float() into the fp32 region")


def _inference(facts: ScriptFacts, scope: Scope, before: int, modules: dict[str, str]) -> Inference:
    """Names' dtypes as the region at line ``before`` sees them: low only when computed before it."""
    def lookup(name: str) -> str | None:
        dtype, line = facts.name_dtypes.get((id(scope), name), (None, 0))
        return None if dtype == LOW and line >= before else dtype
    return Inference(lookup, facts.qualified, modules.get)


# the arguments that hold a promoting op's tensor inputs (not `reduction=`, `dim=`, `margin=`)
_TENSOR_KEYWORDS = frozenset({"input", "target", "other", "var", "x1", "x2", "anchor", "positive", "negative"})


def _may_promote(call: Call, written: list[Arg], dtypes: list[str | None], modules: dict[str, str]) -> bool:
    """A promoting op (``promotes_inputs``: F.l1_loss, F.mse_loss, torch.add) one of whose
    tensor inputs has a dtype the lint cannot tell: fp32 there lifts the op to fp32 - RVC's
    ``F.l1_loss(y_mel, y_hat_mel)``, the mel the slice of a function's result (its ``log`` runs
    in fp32 under autocast), the prediction ``.half()``-ed. Unknown stays unknown: no finding."""
    catalog = builtin_catalog()
    module = modules.get(dotted(call.node.func) or "")
    if module is not None:
        kind = catalog.modules.get(module)
    else:
        last = next(iter(sorted(call.names)), "")
        kind = catalog.canonical_kind(last.rsplit(".", 1)[-1])
    if kind not in catalog.trait("promotes_inputs"):
        return False
    return any(dtype is None and (arg.keyword is None or arg.keyword in _TENSOR_KEYWORDS)
               and not _literal(arg.value) for arg, dtype in zip(written, dtypes, strict=True))


def _literal(value: ast.expr) -> bool:
    """A Python number or string (``2.0``, ``-1``): it takes no part in a tensor's dtype."""
    while isinstance(value, ast.UnaryOp):
        value = value.operand
    return isinstance(value, ast.Constant)


def _root_name(value: ast.expr) -> str | None:
    """``out`` for ``out``, ``out["logits"]``, ``out.logits``, ``out.view(-1)[:, :2]``."""
    while isinstance(value, (ast.Subscript, ast.Attribute, ast.Call)):
        if isinstance(value, ast.Call):
            if not isinstance(value.func, ast.Attribute):
                return None
            value = value.func
        value = value.value
    return value.id if isinstance(value, ast.Name) else None


def _is_cast(call: Call) -> bool:
    return call.method in ("float", "double", "to", "type")


def _constructor(call: Call) -> bool:
    """``Generator()``: building the model, not running it."""
    name = (dotted(call.node.func) or "").rsplit(".", 1)[-1]
    return name[:1].isupper()
