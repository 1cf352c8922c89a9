"""The GEMMs of a model that fp8 training leaves alone: torchao's ``convert_to_float8_training``
(and so ``check --dtype fp8``) converts ``nn.Linear`` only. GPT-2-style models compute their
projections in transformers' ``Conv1D``; ``nn.MultiheadAttention`` reads its in-projection
parameter and its out-projection's weight itself (never calling ``out_proj``); CNNs convolve;
a mixture of experts keeps its experts' weights stacked in 3-D parameters and routes with a
weight of its own.
A user reading a table of one Linear should know why the rest is missing."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from torch import nn

from ampaudit.core.listing import listed

_KINDS = (  # (one, several, does this module compute such a GEMM)
    ("transformers Conv1D", "transformers Conv1D layers",
     lambda m: type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None and m.weight.dim() == 2),
    # its forward reads in_proj_weight and out_proj.weight itself: out_proj, a Linear, never runs as one
    ("nn.MultiheadAttention (in- and out-projection)", "nn.MultiheadAttention (in- and out-projections)",
     lambda m: isinstance(m, nn.MultiheadAttention)),
    ("nn.Bilinear", "nn.Bilinear layers", lambda m: isinstance(m, nn.Bilinear)),
    ("convolution", "convolutions", lambda m: isinstance(m, nn.modules.conv._ConvNd)),
    # a mixture of experts' stacked expert weights (transformers 5's MixtralExperts: gate_up_proj
    # (experts, 2*ffn, hidden), each expert's GEMM an F.linear on a slice) - most of such a model's GEMMs
    ("MoE experts module (3-D expert weights)", "MoE experts modules (3-D expert weights)",
     lambda m: not isinstance(m, nn.modules.conv._ConvNd) and any(
         p.dim() == 3 and min(p.shape) > 1 for p in m.parameters(recurse=False))),  # not a (1, N, D) position table
    # its router's weight read with F.linear (MixtralTopKRouter), not an nn.Linear
    ("MoE router", "MoE routers", lambda m: type(m).__name__.endswith("Router") and not isinstance(m, nn.Linear)
     and getattr(m, "weight", None) is not None and m.weight.dim() == 2),
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


def unrun_linears(model: nn.Module, ran: Collection[str]) -> list[str]:
    """The nn.Linear layers (by name) that did not run as modules on the example inputs - those
    ``ran`` does not name - but for nn.MultiheadAttention's out-projection, noted above."""
    inside_mha = {f"{name}.{child}" if name else child for name, m in model.named_modules()
                  if isinstance(m, nn.MultiheadAttention) for child, _ in m.named_children()}
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name not in ran and name not in inside_mha]


def unrun_linears_note(names: list[str]) -> str | None:
    """BEiT's and EVA's qkv: an nn.Linear whose weight the attention reads with ``F.linear`` itself.
    Its GEMM is not measured, and torchao's Float8Linear, never called, leaves it in high precision."""
    if not names:
        return None
    return (f"not audited: {len(names)} nn.Linear never called as a module on the example inputs "
            f"({listed(names, 3)}) - a forward that reads its weight itself (F.linear(x, self.qkv.weight), "
            f"as BEiT's attention does) runs that GEMM in high precision even once torchao converts the layer")
