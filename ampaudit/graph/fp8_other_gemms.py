"""The GEMMs of a model that fp8 training leaves alone: torchao's ``convert_to_float8_training``
(and so ``check --dtype fp8``) converts ``nn.Linear`` only. GPT-2-style models compute their
projections in transformers' ``Conv1D``; ``nn.MultiheadAttention`` reads its in-projection
parameter and its out-projection's weight itself (never calling ``out_proj``); CNNs convolve.
A user reading a table of one Linear should know why the rest is missing."""

from __future__ import annotations

from collections import Counter

from torch import nn

_KINDS = (  # (one, several, does this module compute such a GEMM)
    ("transformers Conv1D", "transformers Conv1D layers",
     lambda m: type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None and m.weight.dim() == 2),
    # its forward reads in_proj_weight and out_proj.weight itself: out_proj, a Linear, never runs as one
    ("nn.MultiheadAttention (in- and out-projection)", "nn.MultiheadAttention (in- and out-projections)",
     lambda m: isinstance(m, nn.MultiheadAttention)),
    ("nn.Bilinear", "nn.Bilinear layers", lambda m: isinstance(m, nn.Bilinear)),
    ("convolution", "convolutions", lambda m: isinstance(m, nn.modules.conv._ConvNd)),
)


def other_gemms(model: nn.Module) -> Counter[int]:
    """How many modules of each kind (its index in ``_KINDS``) compute a GEMM fp8 training does not convert."""
    found: Counter[int] = Counter()
    for module in model.modules():
        kind = next((i for i, (_, _, match) in enumerate(_KINDS) if match(module)), None)
        if kind is not None:
            found[kind] += 1
    return found


def other_gemms_note(found: Counter[int]) -> str | None:
    """One line for the report; None when every GEMM is an nn.Linear."""
    if not found:
        return None
    kinds = ", ".join(f"{n} {_KINDS[kind][0] if n == 1 else _KINDS[kind][1]}" for kind, n in sorted(found.items()))
    return (f"not audited: {kinds} - not nn.Linear, so torchao's convert_to_float8_training leaves them in "
            "high precision (they train as they do today)")
