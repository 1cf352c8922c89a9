"""Which ``with`` contexts are autocast regions, and of what device and dtype: the
``torch.autocast`` family and a framework's own ``x.autocast()``, called in the ``with``
or held in a variable first (``ctx = torch.autocast(...)``, ``partial(torch.autocast, ...)``,
``accelerator.autocast if amp else nullcontext``)."""

from __future__ import annotations

import ast
from collections.abc import Callable

from ampaudit.check.lint.facts import BFLOAT16_NAMES, FLOAT16_NAMES, Autocast, Scope
from ampaudit.check.lint.nodes import arguments
from ampaudit.check.lint.source import SourceText
from ampaudit.check.lint.values import is_false, string_value
from ampaudit.core.dtypes import BFLOAT16, FLOAT16

AUTOCASTS = {  # qualified name -> the device it implies (None: given as an argument)
    "torch.autocast": None, "torch.amp.autocast": None, "torch.amp.autocast_mode.autocast": None,
    "torch.cuda.amp.autocast": "cuda", "torch.cpu.amp.autocast": "cpu",
}
_NAMES = (ast.Name, ast.Attribute)
Qualify = Callable[[ast.AST], frozenset[str]]  # an expression's qualified names (ImportMap.qualify)


def device(qualify: Qualify, func: ast.expr) -> str | bool | None:
    """The device an autocast callee implies (None: an argument, or a framework's own
    ``x.autocast``); False when ``func`` is no autocast."""
    for name in qualify(func):
        if name in AUTOCASTS:
            return AUTOCASTS[name]
    if func.__class__ is ast.Attribute and func.attr == "autocast":
        return None  # accelerator.autocast(), a trainer's own: AMP of some dtype
    return False


def held_in(qualify: Qualify, value: ast.expr) -> ast.Call | None:
    """The autocast call a context variable holds: ``torch.autocast(...)``, one side of
    ``nullcontext() if cpu else torch.autocast(...)``, ``partial(torch.autocast, ...)``, or
    the uncalled function (``accelerator.autocast if amp else nullcontext``). Held on one side
    of a condition only, it is on in the runs where the condition says so: the call it gives
    reads ``enabled=<the condition>`` (llama-recipes' ``autocast = torch.cuda.amp.autocast if
    use_fp16 else nullcontext``, then ``if use_fp16: scaler... else: loss.backward()``)."""
    if value.__class__ is ast.Subscript and value.value.__class__ is ast.Dict:
        return _picked(qualify, value.value, value.slice)
    if value.__class__ is not ast.IfExp:
        return _held(qualify, value)
    body, orelse = _held(qualify, value.body), _held(qualify, value.orelse)
    if body is not None and orelse is not None:
        return body  # an autocast either way: no switch
    if body is None and orelse is None:
        return None
    call, on = (body, value.test) if body is not None else (orelse, ast.UnaryOp(ast.Not(), value.test))
    position = 0 if device(qualify, call.func) is not None else 2  # as region() reads it
    if any(k.arg == "enabled" for k in call.keywords) or len(call.args) > position:
        return call  # its own enabled= says when it is on
    switch = ast.keyword(arg="enabled", value=ast.copy_location(on, value.test))
    return ast.Call(func=call.func, args=call.args, keywords=[*call.keywords, ast.copy_location(switch, value.test)])


def _picked(qualify: Qualify, table: ast.Dict, key: ast.expr) -> ast.Call | None:
    """The autocast a dict of contexts gives for ``key`` (``{"bf16": autocast(dtype=torch.bfloat16),
    "fp16": autocast(dtype=torch.float16), "tf32": nullcontext()}[args.precision]``: LLaMA-Adapter,
    LlamaGen): an autocast whose dtype is ``key`` where the entries' dtypes differ, and whose
    ``enabled=`` is ``key`` where some entry is no autocast."""
    entries = [_held(qualify, v) for v in table.values]
    calls = [c for c in entries if c is not None]
    if not calls:
        return None
    first = calls[0]
    dtypes = {ast.dump(k.value) for c in calls for k in c.keywords if k.arg == "dtype"}
    keywords = [k for k in first.keywords if k.arg not in ("dtype", "enabled")]
    if len(dtypes) == 1 and all(any(k.arg == "dtype" for k in c.keywords) for c in calls):
        keywords += [k for k in first.keywords if k.arg == "dtype"]
    elif dtypes:
        keywords.append(ast.copy_location(ast.keyword(arg="dtype", value=key), key))
    if len(calls) < len(entries):
        keywords.append(ast.copy_location(ast.keyword(arg="enabled", value=key), key))
    # the device, where torch.autocast takes it positionally; a dtype or enabled written
    # positionally would be the picked one's alone
    position = 0 if device(qualify, first.func) is not None else 1
    return ast.Call(func=first.func, args=first.args[:position], keywords=keywords)


def _held(qualify: Qualify, value: ast.expr) -> ast.Call | None:
    for candidate in (value, *(getattr(value, side, None) for side in ("body", "orelse"))):
        if candidate.__class__ in _NAMES and device(qualify, candidate) is not False:
            return ast.Call(func=candidate, args=[], keywords=[])  # `ctx = accelerator.autocast if amp else ...`
        if candidate.__class__ is not ast.Call:
            continue
        if device(qualify, candidate.func) is not False:
            return candidate
        written = arguments(candidate)
        if "functools.partial" in qualify(candidate.func) and written \
                and device(qualify, written[0].value) is not False:
            rest = [a.node for a in written[1:]]
            return ast.Call(func=written[0].value, args=[a for a in rest if a.__class__ is not ast.keyword],
                            keywords=[a for a in rest if a.__class__ is ast.keyword])
    return None


def region(text: SourceText, qualify: Qualify, node: ast.With | ast.AsyncWith, call: ast.Call,
           implied: str | None, scope: Scope) -> Autocast:
    """The autocast block ``node`` opens with ``call``, whose callee implies the device
    ``implied`` (None: read it from the arguments)."""
    written = arguments(call)
    args = [a for a in written if a.keyword is None]
    keywords = {a.keyword: a.value for a in written if a.keyword is not None}
    on = implied
    if on is None:
        value = keywords.get("device_type", args[0].value if args else None)
        on = string_value(value)
    dtype_node = keywords.get("dtype", args[1].value if on is not None and len(args) > 1 else None)
    dtype = dtype_text = None
    if dtype_node is not None:
        names = qualify(dtype_node)
        dtype = FLOAT16 if names & FLOAT16_NAMES else BFLOAT16 if names & BFLOAT16_NAMES else None
        dtype_text = None if dtype else text.code(dtype_node)
    elif on == "cuda":
        dtype = FLOAT16  # CUDA autocast's default
    elif on == "cpu":
        dtype = BFLOAT16
    line, column = text.position(node)
    # enabled is torch.cuda.amp.autocast's first parameter, torch.autocast's third (held_in too)
    position = 0 if implied is not None else 2
    enabled = keywords.get("enabled", args[position].value if len(args) > position else None)
    switched = enabled is not None and not (enabled.__class__ is ast.Constant and type(enabled.value) is bool)
    return Autocast(node, on, dtype, scope, line, column, enabled=not is_false(enabled), dtype_text=dtype_text,
                    switched=switched)
