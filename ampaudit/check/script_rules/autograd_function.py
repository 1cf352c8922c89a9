"""AMP415: a custom torch.autograd.Function in code that uses autocast, without
torch.amp.custom_fwd / custom_bwd, whose forward or backward calls an op autocast casts (or a
kernel the lint cannot see into): its backward runs outside autocast, in whatever dtype forward
happened to get."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampaudit.check.lint.facts import ClassDef, ScriptFacts
from ampaudit.check.lint.nodes import dotted
from ampaudit.check.lint.protocol import finding
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.catalog import builtin_catalog
from ampaudit.core.findings import Finding

_FUNCTION_BASES = frozenset({"torch.autograd.Function", "torch.autograd.function.Function"})
_DECORATORS = {
    "forward": frozenset({"torch.amp.custom_fwd", "torch.cuda.amp.custom_fwd", "torch.amp.autocast_mode.custom_fwd"}),
    "backward": frozenset({"torch.amp.custom_bwd", "torch.cuda.amp.custom_bwd", "torch.amp.autocast_mode.custom_bwd"}),
}
# what autocast does to an op (rules/ops.toml's `autocast`) that makes forward and backward disagree
_CASTS = frozenset({"fp16", "fp32", "banned"})
# what a Function's ctx offers: calling one of these runs no kernel
_CTX_API = frozenset({"save_for_backward", "save_for_forward", "mark_dirty", "mark_non_differentiable",
                      "set_materialize_grads"})
# standard modules a forward computes Python numbers with (math.sqrt(d)): no kernel
_PLAIN_MODULES = frozenset({"math", "operator", "functools", "itertools", "numbers", "warnings", "typing"})


@lint_rule("AMP415", reads=("Function", "custom_[fb]wd", "autocast"))
def autograd_function_without_custom_fwd(facts: ScriptFacts) -> Iterator[Finding]:
    if not facts.autocasts:
        return
    for cls in facts.classes:
        found = function_finding(facts, cls)
        if found is not None:
            yield found


def function_finding(facts: ScriptFacts, cls: ClassDef) -> Finding | None:
    """AMP415 for one class, whether or not its file uses autocast (the model audit asks of
    every Function a model applies, wherever it is defined)."""
    if not cls.bases & _FUNCTION_BASES or _enters_autocast(facts, cls, "backward"):
        return None  # a backward that enters autocast does what custom_bwd is for, by hand
    missing = [m for m, wanted in _DECORATORS.items()
               if m in cls.decorated_methods and not cls.decorated_methods[m] & wanted]
    if not missing or not _dtype_sensitive(facts, cls):
        return None
    return finding(facts, "AMP415", cls, name=cls.node.name, methods=" and ".join(missing),
                   fix='decorate forward with @torch.amp.custom_fwd(device_type="cuda") and backward with '
                       '@torch.amp.custom_bwd(device_type="cuda")')


def _dtype_sensitive(facts: ScriptFacts, cls: ClassDef) -> bool:
    """Whether forward or backward calls an op autocast casts (a matmul, a softmax) or a
    function the lint cannot see into (an extension's kernel). A Function of collectives and
    dtype-keeping ops - VICReg's FullGatherLayer: zeros_like, all_gather, stack, all_reduce -
    gives backward the dtype forward had, with or without custom_fwd."""
    for method in cls.node.body:
        if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef) or method.name not in _DECORATORS:
            continue
        ctx = method.args.args[0].arg if method.args.args else None
        for node in ast.walk(method):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                return True
            if isinstance(node, ast.Call) and _sensitive_call(facts, node, ctx):
                return True
    return False


def _enters_autocast(facts: ScriptFacts, cls: ClassDef, method: str) -> bool:
    """Whether ``method`` enters autocast itself, as custom_bwd would (Stable Diffusion's
    CheckpointFunction: ``with torch.autocast(**ctx.autocast_kwargs)`` in backward)."""
    node = next((m for m in cls.node.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)
                 and m.name == method), None)
    return node is not None and any(node.lineno <= a.line <= (node.end_lineno or node.lineno) and a.enabled
                                    for a in facts.autocasts)


def _sensitive_call(facts: ScriptFacts, call: ast.Call, ctx: str | None) -> bool:
    func = call.func
    name = dotted(func)
    root = name.partition(".")[0] if name is not None else None
    if isinstance(func, ast.Attribute) and root == ctx and ctx is not None and name == f"{ctx}.{func.attr}":
        # ctx's own API saves and marks; anything else called on ctx is a function forward stored
        # there - improved-diffusion's checkpoint runs its block again in backward: a kernel, for all we know
        return func.attr not in _CTX_API
    if isinstance(func, ast.Attribute) and (root is None or root not in facts.imports_map.bound):
        # a method of a local value: a tensor (x.matmul(w)), a list
        return root != ctx and _autocast_casts(func.attr)
    if name is None:
        return True  # kernel[grid](...): a Triton kernel
    qualified = facts.qualified(func)
    if any(q.startswith("builtins.") or q.partition(".")[0] in _PLAIN_MODULES for q in qualified):
        return False
    torch_names = [q for q in qualified if q.startswith("torch.")]
    if not torch_names or any(q.startswith("torch.ops.") for q in torch_names):
        return True  # a function of the user's or another package's, a custom op: a kernel, for all we know
    return any(_autocast_casts(q.rsplit(".", 1)[-1]) for q in torch_names)


def _autocast_casts(op: str) -> bool:
    catalog = builtin_catalog()
    kind = catalog.canonical_kind(op)
    policy = catalog.lookup(kind) if kind else None
    return policy is not None and policy.autocast in _CASTS
