"""What converted models call at run time."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn


@torch.fx.wrap
def cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` in ``dtype`` if it is a floating-point tensor; anything else untouched
    (token ids, masks, Python numbers), so a cast can sit wherever dtypes are unknown."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


@torch.fx.wrap
def call_with(module: nn.Module, names: tuple[str, ...], values: tuple[torch.Tensor, ...], *args: Any,
              **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` with ``values`` (its parameters and buffers ``names``, cast)
    in place of its own for this call - still a call of the module, so its hooks fire: a
    low-precision module whose weights stay fp32 (``weights="fp32"``). Names and values come
    apart because fx freezes a dict argument. A buffer updated in place would update its cast
    copy: modules with running statistics (BatchNorm) compute in fp32 by the catalog and are
    never called this way."""
    return torch.func.functional_call(module, dict(zip(names, values, strict=True)), args, kwargs)
