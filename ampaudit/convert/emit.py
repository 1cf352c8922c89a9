"""A conversion plan in the forms other tools take - useful without ampaudit's runtime.

The plan's *overrides* are what autocast alone gets wrong: ops kept in fp32 because of a
constant the low dtype cannot hold (AMP201), a measured overflow (AMP301), verification, the
model's own declaration, or a missing low-precision kernel. Autocast already runs the
catalog's fp32 ops (softmax, norms, losses) in fp32 on CUDA, so those need nothing there. Each
override names the module it runs in; that module is what the autocast and hf policies keep
in fp32; FSDP2 upcasts no op, so its policy reads the whole plan. The formats:

- ``autocast``: keep ``torch.autocast`` + GradScaler and run those modules with autocast off
  and fp32 inputs (:func:`autocast_policy`, or the standalone file ``--emit autocast`` writes);
- ``hf``: the ``_keep_in_fp32_modules`` list for a transformers model, for inference (fp16
  weights do not train);
- ``fsdp2``: ``fully_shard`` with a low-precision ``MixedPrecisionPolicy`` on the modules whose
  ops all compute low, fp32 on the rest (FSDP2 casts parameters, not ops: :func:`low_modules`).
"""

from __future__ import annotations

import json
import re
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ampaudit.convert.publish import EMIT_FILES
from ampaudit.core.errors import UsageError
from ampaudit.graph.model_copy import copied_whole

FORMATS = ("autocast", "hf", "fsdp2")
OVERRIDES = frozenset({"AMP201", "AMP301", "verify", "declared", "kernel", "untraced"})
FILES = EMIT_FILES  # the file each format is written to


def read_plan(plan: Any) -> tuple[list[Mapping[str, Any]], str]:
    """The records and low dtype of a plan given as a converted model, an export folder, a
    plan.json path or plan.json's content."""
    if isinstance(plan, torch.nn.Module):
        return list(plan.plan) + _untraced(getattr(plan.summary, "untraced", [])), plan.summary.dtype
    if isinstance(plan, (str, Path)):
        path = Path(plan) / "plan.json" if Path(plan).is_dir() else Path(plan)
        try:
            plan = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read the plan {path}: {exc}") from None
    if isinstance(plan, Mapping) and "plan" in plan:
        records, summary = plan["plan"], plan.get("summary", {})
        if not isinstance(records, list) or not all(isinstance(r, Mapping) for r in records) \
                or not isinstance(summary, Mapping):
            raise UsageError("a plan's \"plan\" is a list of records (tables) and its \"summary\" a table: "
                             "give a converted model, an export folder, a plan.json path or its content")
        return list(records) + _untraced(summary.get("untraced") or []), str(summary.get("dtype", "float16"))
    raise UsageError("a plan is a converted model, an export folder, a plan.json path or its content")


def _untraced(paths: Iterable[str]) -> list[dict[str, Any]]:
    """A record for each module whose own forward the fx backend kept in fp32 untraced: its ops
    are in no record, and under plain autocast they ran low (a -1e9 fill raised)."""
    return [{"module": str(p), "compute": "float32", "rule": "untraced"} for p in paths]


def fp32_modules(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """The outermost modules holding an op the plan overrides to fp32, in plan order; ``""``
    (the model itself: ``get_submodule("")``) when the root's own forward holds one - its
    records name no module, and leaving it out left that op to autocast's low dtype."""
    found: list[str] = []
    for record in records:
        module = record.get("module") or ""
        overridden = record.get("compute") == "float32" and record.get("rule") in OVERRIDES
        if overridden and module not in found:
            found.append(module)
    if "" in found:
        return [""]
    return [m for m in found if not any(m.startswith(other + ".") for other in found)]


def autocast_policy(model: torch.nn.Module, plan: Any) -> list[str]:
    """Run the plan's fp32 modules of ``model`` with autocast disabled and fp32 inputs, in
    place; returns their paths. Plain Python around forward, so torch.compile traces it."""
    records, _ = read_plan(plan)
    paths = fp32_modules(records)
    for path in paths:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise UsageError(f"the plan keeps {path} in fp32, but the model has no such module") from None
        run_in_fp32(module)
    return paths


def run_in_fp32(module: torch.nn.Module) -> None:
    """``module``'s forward with autocast off and fp32 inputs, in place. A method bound to the
    module, not a closure over its forward: a deep copy of the model calls its own modules.
    A forward the instance holds already (accelerate's offload hook, which loads the weights)
    is kept and called inside; calling the class's forward skipped it (weights on "meta")."""
    inner = module.__dict__.get("forward")
    if getattr(inner, "__func__", None) is _fp32_forward:
        return  # applied already
    if inner is not None:
        module._ampaudit_fp32_inner = inner
    module.forward = types.MethodType(_fp32_forward, module)
    copied_whole(module)


def _fp32_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    inner = getattr(self, "_ampaudit_fp32_inner", None)
    with torch.autocast(device_type(args, kwargs), enabled=False):
        args, kwargs = float_inputs(args), float_inputs(kwargs)
        return inner(*args, **kwargs) if inner is not None else type(self).forward(self, *args, **kwargs)


def device_type(args: tuple, kwargs: dict) -> str:
    """The device type of a call's first tensor argument (autocast is per device type)."""
    return next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), "cpu")


def float_inputs(value: Any) -> Any:
    """Float tensors (in tuples, lists and dicts) as fp32; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        items = [float_inputs(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple
    if isinstance(value, dict):
        return {k: float_inputs(v) for k, v in value.items()}
    return value


def emit(plan: Any, format: str) -> str:
    """The plan as Python source in ``format`` (one of FORMATS)."""
    records, dtype = read_plan(plan)
    modules = fp32_modules(records)
    if format == "autocast":
        untraced = [str(r["module"]) for r in records if r.get("rule") == "untraced"]
        note = (f"# {', '.join(repr(u) for u in untraced)}: forward not traced (--backend fx), so it runs in fp32 "
                "whole, as\n# in the converted model; --backend modules plans its ops one by one\n") if untraced else ""
        return _AUTOCAST.format(modules=_pylist(modules), untraced=note)
    if format == "hf":
        names = [hf_name(m) for m in modules if m]
        # transformers applies _keep_in_fp32_modules under float16 only; bfloat16 needs _strict
        attribute = "_keep_in_fp32_modules" + ("_strict" if dtype == "bfloat16" else "")
        return _HF.format(names=_pylist(names), modules=_pylist(modules), dtype=dtype, attribute=attribute,
                          root=_HF_ROOT if "" in modules else "")
    if format == "fsdp2":
        low = {"float16": "torch.float16", "bfloat16": "torch.bfloat16"}.get(dtype, "torch.bfloat16")
        units, fp32_with_low = low_modules(records, dtype)
        return _FSDP2.format(low=low, dtype=dtype, units=_pylist(units), overrides=_pylist(modules),
                             fp32_with_low=_pylist(fp32_with_low))
    raise UsageError(f"--emit {format!r}: choose one of {', '.join(FORMATS)}")


def hf_name(path: str) -> str:
    """A module path as a ``_keep_in_fp32_modules`` entry that matches that module only.

    transformers reads the entries as regular expressions: 5.x searches each weight's name for
    them, 4.x matches them between dots. A last name alone (``mlp`` for ``model.layers.1.mlp``)
    kept every layer's mlp in fp32, and ``1`` every weight with a 1 in its name (``ln_1``); the
    whole path does not, once an index at its end is kept from matching longer ones
    (``h.1`` would match ``h.10``), and once it is escaped (a ModuleDict key ``a+b``, and the
    dots, are literal)."""
    escaped = re.escape(path)
    return escaped + r"(?=\.)" if path.rsplit(".", 1)[-1].isdigit() else escaped


def low_modules(records: Iterable[Mapping[str, Any]], dtype: str) -> tuple[list[str], list[str]]:
    """For a policy that sets dtypes per module (FSDP2's ``param_dtype``): the called modules
    whose every op computes in ``dtype`` or follows its inputs, with at least one in ``dtype``,
    nested ones included, in plan order; and the modules holding a ``dtype`` op in their own
    forward that are not among them (an fp32 op beside it: it computes in fp32 there).

    FSDP2 casts a module's parameters, not its ops: every op outside these modules runs in
    fp32 only if they are the only low-precision ones, so a module holding a catalog fp32
    op (a norm, softmax, the loss) or an override is never one of them."""
    fp32: set[str] = set()
    low: set[str] = set()
    called: set[str] = set()  # modules with ops of their own: their forward ran
    order: dict[str, None] = {}
    for record in records:
        module = record.get("module") or ""
        called.add(module)
        parts = module.split(".") if module else []
        for depth in range(1, len(parts) + 1):
            order.setdefault(".".join(parts[:depth]))
        if record.get("compute") == "float32" or record.get("rule") in OVERRIDES:
            fp32.add(module)
        elif record.get("compute") == dtype:
            low.add(module)

    def inside(path: str, outer: str) -> bool:
        return path == outer or path.startswith(outer + ".")

    # a unit must be called: FSDP2 gathers a unit's parameters in its forward, which a
    # ModuleList, or a module whose children its parent calls, never runs
    units = [m for m in order if m in called and any(inside(p, m) for p in low)
             and not any(inside(p, m) for p in fp32)]
    return units, [m for m in ("", *order) if m in low and not any(inside(m, u) for u in units)]


def _pylist(items: list[str]) -> str:
    return "[\n" + "".join(f"    {item!r},\n" for item in items) + "]" if items else "[]"


_AUTOCAST = '''"""Modules to run in fp32 under torch.autocast, from an ampaudit convert plan.

Usage, with an unchanged autocast + GradScaler training loop:

    from autocast_policy import apply
    apply(model)      # before torch.compile(model), if you compile
"""

import types

import torch

{untraced}FP32_MODULES = {modules}


def apply(model: torch.nn.Module) -> None:
    for path in FP32_MODULES:
        module = model.get_submodule(path)
        inner = module.__dict__.get("forward")  # the instance's own (accelerate's offload hook): kept
        if getattr(inner, "__func__", None) is _fp32_forward:
            continue  # applied already
        if inner is not None:
            module._fp32_policy_inner = inner
        module.forward = types.MethodType(_fp32_forward, module)  # bound: copy.deepcopy(model) still works


def _fp32_forward(self, *args, **kwargs):
    inner = getattr(self, "_fp32_policy_inner", None)
    device = next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), "cpu")
    with torch.autocast(device, enabled=False):
        args, kwargs = _float(args), _float(kwargs)
        return inner(*args, **kwargs) if inner is not None else type(self).forward(self, *args, **kwargs)


def _float(value):
    """Float tensors, also in tuples, lists and dicts (self.attn((q, k, v))), as fp32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        items = [_float(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple
    if isinstance(value, dict):
        return {{k: _float(v) for k, v in value.items()}}
    return value
'''

_HF = '''"""For a transformers model: the module names to keep in fp32, from an ampaudit convert plan.

For inference, not for training: from_pretrained(..., torch_dtype=torch.{dtype}) stores every
other weight in {dtype}, and low-precision weights do not train: in float16 their gradients are
fp16, which GradScaler refuses to unscale, and without it AdamW's eps (1e-8) is 0 in fp16, so
its first step makes NaN weights wherever a gradient is 0 (a tiny GPT-2's loss is NaN at step
2); in bfloat16 an update below 1/256 of a weight rounds away.
To train, keep the weights fp32 and use torch.autocast + GradScaler with the autocast policy
(ampaudit convert --emit autocast), or ampaudit.convert(model, optimizer, example_inputs=...).

Each name is a module's whole path in the converted model (transformers reads them as regular
expressions over weight names; a path ending in an index is followed by a look-ahead for a
dot, so that h.1 is not h.10); set it on that model's class before
from_pretrained(..., torch_dtype=torch.{dtype}):

    MyModel.{attribute} = KEEP_IN_FP32

({attribute}: transformers applies _keep_in_fp32_modules under float16 only, and
_keep_in_fp32_modules_strict under float16 and bfloat16.)
{root}"""

ATTRIBUTE = {attribute!r}

KEEP_IN_FP32 = {names}

# the modules the plan keeps in fp32, by path
FP32_MODULES = {modules}
'''

_HF_ROOT = """
NOT EXPRESSIBLE HERE: the plan keeps an op of the model's own forward (its root, '' below)
in fp32, and _keep_in_fp32_modules names submodules only; load it in fp32, or run it under
torch.autocast with the autocast policy (which runs the whole forward in fp32).
"""

_FSDP2 = '''"""FSDP2 mixed precision from an ampaudit convert plan, for a forward without torch.autocast.

FSDP2 casts each fully_shard unit's parameters to its param_dtype; it does not upcast ops as
autocast does. So only the modules below compute in {dtype}, each its own unit: their inputs
are cast to {dtype} on the way in and their outputs back to fp32 on the way out. The root,
and everything outside them - norms, softmax, the loss, embeddings, the plan's overrides -
computes in fp32 with fp32 parameters. Gradients reduce in fp32.

    import torch.distributed as dist
    from fsdp2_policy import shard
    dist.init_process_group("nccl")
    shard(model)                   # instead of your own fully_shard calls; kwargs (mesh=...) pass on
    scaler = torch.amp.GradScaler()  # float16: scale the loss, as with autocast

shard() skips a listed module that shares a parameter with a module outside it (a tied
embedding) or holds a floating-point buffer (it would reach the module's low-precision ops
uncast); its listed children are sharded instead, and the rest of it computes in fp32.
FSDP2 may warn that a unit "returned a view tensor": each unit's output is cast to fp32
after that check, a new tensor, so in-place ops on it are safe.
"""

import torch

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

# the modules computing in {dtype} (nested ones too: shard() takes the outermost it can)
LOW_MODULES = {units}

# the plan's overrides: ops that autocast alone would run in {dtype} (outside LOW_MODULES: fp32)
FP32_MODULES = {overrides}

# low-precision ops in these modules' own forward ('' is the root) compute in fp32 here (an
# fp32 op shares the module); under autocast they would run in {dtype}
FP32_WITH_LOW_OPS = {fp32_with_low}

LOW = MixedPrecisionPolicy(param_dtype={low}, reduce_dtype=torch.float32, output_dtype=torch.float32,
                           cast_forward_inputs=True)
FP32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)


def shard(model: torch.nn.Module, **kwargs) -> list[str]:
    """fully_shard the low-precision modules with LOW, then the root with FP32; returns the
    modules sharded with LOW."""
    owners = {{}}  # parameter -> the module paths holding it
    for path, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(param, set()).add(path)
    chosen = []
    for path in LOW_MODULES:
        if any(path.startswith(outer + ".") for outer in chosen):
            continue
        module = model.get_submodule(path)
        shared = any(not all(o == path or o.startswith(path + ".") for o in owners[p]) for p in module.parameters())
        if shared or any(b.is_floating_point() for b in module.buffers()):
            continue
        chosen.append(path)
    for path in chosen:
        fully_shard(model.get_submodule(path), mp_policy=LOW, **kwargs)
    fully_shard(model, mp_policy=FP32, **kwargs)
    return chosen
'''
