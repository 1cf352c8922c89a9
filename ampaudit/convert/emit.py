"""A conversion plan in the forms other tools take - useful without ampaudit's runtime.

The plan's *overrides* are what autocast alone gets wrong: ops kept in fp32 because of a
constant the low dtype cannot hold (AMP201), a measured overflow (AMP301), verification, the
model's own declaration, or a missing low-precision kernel. Autocast already runs the
catalog's fp32 ops (softmax, norms, losses) in fp32, so those need nothing. Each override
names the module it runs in; that module is what the policies keep in fp32:

- ``autocast``: keep ``torch.autocast`` + GradScaler and run those modules with autocast off
  and fp32 inputs (:func:`autocast_policy`, or the standalone file ``--emit autocast`` writes);
- ``hf``: the ``_keep_in_fp32_modules`` list for a transformers model;
- ``fsdp2``: ``MixedPrecisionPolicy`` per module, to paste before ``fully_shard``.
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ampaudit.convert.publish import EMIT_FILES
from ampaudit.core.errors import UsageError

FORMATS = ("autocast", "hf", "fsdp2")
OVERRIDES = frozenset({"AMP201", "AMP301", "verify", "declared", "kernel"})
FILES = EMIT_FILES  # the file each format is written to


def read_plan(plan: Any) -> tuple[list[Mapping[str, Any]], str]:
    """The records and low dtype of a plan given as a converted model, an export folder, a
    plan.json path or plan.json's content."""
    if isinstance(plan, torch.nn.Module):
        return list(plan.plan), plan.summary.dtype
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
        return list(records), str(summary.get("dtype", "float16"))
    raise UsageError("a plan is a converted model, an export folder, a plan.json path or its content")


def fp32_modules(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """The outermost modules holding an op the plan overrides to fp32, in plan order."""
    found: list[str] = []
    for record in records:
        module = record.get("module")
        overridden = record.get("compute") == "float32" and record.get("rule") in OVERRIDES
        if overridden and module and module not in found:
            found.append(module)
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
    module, not a closure over its forward: a deep copy of the model calls its own modules."""
    module.forward = types.MethodType(_fp32_forward, module)


def _fp32_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    with torch.autocast(device_type(args, kwargs), enabled=False):
        return type(self).forward(self, *float_inputs(args), **float_inputs(kwargs))


def device_type(args: tuple, kwargs: dict) -> str:
    """The device type of a call's first tensor argument (autocast is per device type)."""
    return next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), "cpu")


def float_inputs(value: Any) -> Any:
    """Float tensors (in tuples and dicts) as fp32; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(float_inputs(v) for v in value)
    if isinstance(value, dict):
        return {k: float_inputs(v) for k, v in value.items()}
    return value


def emit(plan: Any, format: str) -> str:
    """The plan as Python source in ``format`` (one of FORMATS)."""
    records, dtype = read_plan(plan)
    modules = fp32_modules(records)
    if format == "autocast":
        return _AUTOCAST.format(modules=_pylist(modules))
    if format == "hf":
        names = list(dict.fromkeys(m.rsplit(".", 1)[-1] for m in modules))
        return _HF.format(names=_pylist(names), modules=_pylist(modules))
    if format == "fsdp2":
        low = {"float16": "torch.float16", "bfloat16": "torch.bfloat16"}.get(dtype, "torch.bfloat16")
        lines = "".join(f'    fully_shard(model.get_submodule("{m}"), mp_policy=FP32)\n' for m in modules)
        return _FSDP2.format(low=low, lines=lines or "    pass  # the plan keeps no module in fp32\n")
    raise UsageError(f"--emit {format!r}: choose one of {', '.join(FORMATS)}")


def _pylist(items: list[str]) -> str:
    return "[\n" + "".join(f"    {item!r},\n" for item in items) + "]" if items else "[]"


_AUTOCAST = '''"""Modules to run in fp32 under torch.autocast, from an ampaudit convert plan.

Usage, with an unchanged autocast + GradScaler training loop:

    from autocast_policy import apply
    apply(model)      # before torch.compile(model), if you compile
"""

import types

import torch

FP32_MODULES = {modules}


def apply(model: torch.nn.Module) -> None:
    for path in FP32_MODULES:
        module = model.get_submodule(path)
        module.forward = types.MethodType(_fp32_forward, module)  # bound: copy.deepcopy(model) still works


def _fp32_forward(self, *args, **kwargs):
    device = next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), "cpu")
    with torch.autocast(device, enabled=False):
        args = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        kwargs = {{k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in kwargs.items()}}
        return type(self).forward(self, *args, **kwargs)
'''

_HF = '''"""For a transformers model: the module names to keep in fp32, from an ampaudit convert plan.

transformers matches each name against module paths at dot boundaries; set it on the model
class before from_pretrained(..., torch_dtype=torch.float16):

    MyModel._keep_in_fp32_modules = KEEP_IN_FP32
"""

KEEP_IN_FP32 = {names}

# the modules the plan keeps in fp32, by path
FP32_MODULES = {modules}
'''

_FSDP2 = '''"""FSDP2 mixed-precision policies, from an ampaudit convert plan: the plan's fp32 modules get
an fp32 policy, everything else computes in the low dtype with fp32 gradient reduction.
Paste before sharding the model (fully_shard the inner modules first, then the root):
"""

import torch

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

LOW = MixedPrecisionPolicy(param_dtype={low}, reduce_dtype=torch.float32)
# inputs come in as the low dtype and are cast up; outputs go back down for the next module
FP32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype={low})


def shard(model: torch.nn.Module) -> None:
{lines}    fully_shard(model, mp_policy=LOW)
'''
