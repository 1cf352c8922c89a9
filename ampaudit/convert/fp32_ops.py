"""The plan's fp32 ops kept in fp32 under ``torch.autocast``, on every device.

The modules backend leaves a module's own functional ops to autocast, but autocast's lists
are per device and the catalog describes CUDA's: CPU autocast runs softmax, exp, log and the
norms in float16, and no device upcasts ``mean``, ``var``, ``sin`` or ``cos``. So while a
converted forward runs under autocast, a ``TorchFunctionMode`` gives each op the plan
computes in fp32 fp32 inputs - matched by its kind and the user's line (plan records name
both), so one ``pow`` the plan keeps low is not upcast with another. Ops autocast upcasts on
the device itself are left to it (on CUDA the mode is usually not installed at all). The other
way round, the plan's low ops that no autocast lowers (``torch._grouped_mm``, MoE experts) get
their fp32 inputs cast down at their sites.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ampaudit.core.catalog import Catalog
from ampaudit.core.userframe import user_location

_LOW = (torch.float16, torch.bfloat16)
_LOW_NAMES = {str(d).removeprefix("torch."): d for d in _LOW}
_CALLS = ("call_function", "call_method")


class Fp32Ops:
    """Where the plan computes a catalog fp32 op in fp32, or a low op autocast leaves alone in
    the low dtype: (kind, file name, line) sites."""

    def __init__(self, records: Iterable[Mapping[str, Any]], catalog: Catalog, ran: Iterable[str] = ()) -> None:
        # the caller passes the records its sites come from (the modules backend: unruled ones
        # and the overrides it upcasts at their own op); ``ran``: the kinds of every op the plan
        # holds, whose kernels that refuse mixed float dtypes get their inputs cast to the widest
        records = list(records)
        sites = [r for r in records if r.get("op") in _CALLS and r.get("compute") == "float32"]
        self.sites = frozenset((r["kind"], os.path.basename(str(r["file"])), r["line"]) for r in sites)
        # the plan's low ops that no device's autocast lowers (``torch._grouped_mm``, the MoE
        # experts' matmul: transformers casts its input to the fp32 weights' dtype): their fp32
        # inputs are cast down here, or the experts compute in fp32 while the plan says low
        low = [r for r in records if r.get("op") in _CALLS and r.get("compute") in _LOW_NAMES
               and (p := catalog.lookup(str(r["kind"]))) is not None and p.precision.value == "fp16"
               and p.autocast == "none"]
        self.low_sites = {(r["kind"], os.path.basename(str(r["file"])), r["line"]): _LOW_NAMES[r["compute"]]
                          for r in low}
        self.low_kinds = frozenset(kind for kind, _, _ in self.low_sites)
        # the low sites whose cast-down call raised (no kernel for these shapes in the low dtype:
        # CPU's fp16 grouped_mm wants strides of whole 16 bytes): convert keeps them in fp32
        self.failed: set[tuple[str, str, int]] = set()
        self._modules = frozenset(str(r["module"]) for r in [*sites, *low] if r.get("module") is not None)
        kinds = {kind for kind, _, _ in self.sites}
        # CUDA autocast upcasts these itself (the catalog's autocast column)
        upcast_by_cuda = {k for k in kinds if (p := catalog.lookup(k)) is not None
                          and (p.autocast in ("fp32", "banned") or p.fp32_under_autocast)}
        self.kinds = {"cuda": frozenset(kinds - upcast_by_cuda), None: frozenset(kinds)}
        same = catalog.trait("same_dtype_inputs") & frozenset(ran)
        promoted_by_cuda = {k for k in same if (p := catalog.lookup(k)) is not None and p.autocast == "promote"}
        self.same_dtype = {"cuda": frozenset(same - promoted_by_cuda), None: frozenset(same)}
        self.catalog = catalog
        self._kind_of: dict[Any, str | None] = {}
        self._depth = 0  # forwards in flight that entered the mode

    def modules(self) -> frozenset[str]:
        """The modules whose own forward holds one of the sites."""
        return self._modules

    def __deepcopy__(self, memo: dict) -> Fp32Ops:
        return self  # read-only once built: copies of the converted model share it

    def __getstate__(self) -> dict[str, Any]:
        # a pickle of the converted model (torch.save(model)): the cache is keyed by torch's
        # functions, some of which pickle by no name (TensorBase.pow); no forward is in flight
        return {**self.__dict__, "_kind_of": {}, "_depth": 0, "failed": set()}

    @contextlib.contextmanager
    def entered(self, device_type: str) -> Iterator[None]:
        """The mode, for a forward on ``device_type``, unless an outer forward entered it. Each
        module holding a site enters it, not only the model's forward: activation checkpointing
        runs a block's forward again in backward, outside the model's forward."""
        kinds = self.kinds.get(device_type, self.kinds[None])
        same = self.same_dtype.get(device_type, self.same_dtype[None])
        if self._depth or not (kinds or same or self.low_kinds):
            yield
            return
        self._depth += 1
        try:
            with _Upcast(self, kinds, same):
                yield
        finally:
            self._depth -= 1

    def kind(self, func: Any) -> str | None:
        """The catalog kind of a torch function or Tensor method; None for in-place ones."""
        if func not in self._kind_of:
            name = getattr(func, "__name__", "") or ""
            in_place = (name.endswith("_") and not name.endswith("__")) or \
                (name.startswith("__i") and name.endswith("__") and name != "__invert__")
            self._kind_of[func] = None if in_place or not name else self.catalog.canonical_kind(name)
        return self._kind_of[func]


class _Upcast(TorchFunctionMode):
    def __init__(self, ops: Fp32Ops, kinds: frozenset[str], same_dtype: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.ops, self.kinds, self.same_dtype = ops, kinds, same_dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self.ops.kind(func)
        # out=None is passed on by F.normalize and its like: only a real out= tensor is left alone
        if kind in self.kinds and kwargs.get("out") is None and _has_low(args, kwargs):
            loc = user_location(sys._getframe(1))
            if loc is not None and (kind, os.path.basename(loc.file), loc.line) in self.ops.sites:
                args, kwargs = _up(args), _up(kwargs)
                # a composite op (F.normalize: a norm, then a division) runs its own ops under
                # autocast too, whose CPU policy casts the norm down again: off for the site
                with _autocast_off(_device_type(args, kwargs)):
                    return func(*args, **kwargs)
        if kind in self.ops.low_kinds and kwargs.get("out") is None:
            loc = user_location(sys._getframe(1))
            site = None if loc is None else (kind, os.path.basename(loc.file), loc.line)
            low = self.ops.low_sites.get(site) if site is not None else None
            if low is not None:
                args, kwargs = _to(args, low, (torch.float32,)), _to(kwargs, low, (torch.float32,))
                try:
                    return func(*args, **kwargs)
                except RuntimeError:
                    self.ops.failed.add(site)
                    raise
        if kind in self.same_dtype and kwargs.get("out") is None:
            # an fp32 op's output meeting a low one where the kernel wants one dtype (EDM2's
            # ``a.lerp(b, t)``): what type promotion would give, the widest
            dtypes = _float_dtypes((*args, *kwargs.values()))
            if len(dtypes) > 1:
                wide = torch.float32 if not dtypes - set(_LOW) - {torch.float32} else torch.float64
                args, kwargs = _to(args, wide), _to(kwargs, wide)
        return func(*args, **kwargs)


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off on ``device_type`` where it is on; as it is on a device autocast does not know."""
    try:
        return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) \
            else contextlib.nullcontext()
    except RuntimeError:  # "unsupported autocast device_type" (meta, a backend without autocast)
        return contextlib.nullcontext()


def _device_type(args: tuple, kwargs: dict) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
        if isinstance(value, (list, tuple)) and value:
            return _device_type(tuple(value), {})
    return "cpu"


def _float_dtypes(values: Iterable[Any]) -> set[torch.dtype]:
    found: set[torch.dtype] = set()
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            found.add(v.dtype)
        elif isinstance(v, (list, tuple)):
            found |= _float_dtypes(v)
    return found


def _to(value: Any, dtype: torch.dtype, only: tuple[torch.dtype, ...] | None = None) -> Any:
    """Float tensors in ``value`` (a tensor, list, tuple or dict) as ``dtype`` - those of the
    dtypes in ``only``, where given; the rest as they are."""
    if isinstance(value, torch.Tensor):
        cast = value.is_floating_point() and value.dtype != dtype and (only is None or value.dtype in only)
        return value.to(dtype) if cast else value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to(v, dtype, only) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, dtype, only) for k, v in value.items()}
    return value


def _has_low(args: tuple, kwargs: dict) -> bool:
    return not _float_dtypes((*args, *kwargs.values())).isdisjoint(_LOW)


def _up(value: Any) -> Any:
    return _to(value, torch.float32, _LOW)
