"""What converted models call at run time."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx


@torch.fx.wrap
def cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` in ``dtype`` if it is a floating-point tensor; anything else untouched
    (token ids, masks, Python numbers), so a cast can sit wherever dtypes are unknown."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value
