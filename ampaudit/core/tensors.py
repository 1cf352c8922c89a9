"""The tensors in a nested value - a call's arguments, a model's output: tuples, lists and
mappings (HF's ModelOutput too). graph's tracers, convert's checks and watch's replays all walk
them. torch is imported when a walk starts, not with this module, as core/ imports without torch."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a nest of tuples, lists and mappings (HF's ModelOutput too), depth first."""
    from torch import Tensor

    return _walk(value, Tensor)


def dense_numel(shape: Sequence[int], stride: Sequence[int]) -> int | None:
    """The elements of a dense layout - every element once, no gap, in some order: contiguous,
    channels_last, a transpose - so that they are one run of memory from the data pointer;
    None for any other layout. watch's row kernels and graph's fp8 passes read such a tensor
    where it lies."""
    n = 1
    for size, step in sorted(((size, step) for size, step in zip(shape, stride, strict=True) if size != 1),
                             key=lambda d: d[1]):
        if step != n:
            return None
        n *= size
    return n


LABEL_NAMES = ("targets", "target", "labels", "label")  # a forward's arguments that are training targets


def given_labels(forward: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a call of ``forward`` passes something it names as training targets (karpathy's
    GPT: ``forward(idx, targets=None)``); False where the signature cannot say (``*args``)."""
    import inspect

    try:
        bound = inspect.signature(forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    return any(name in LABEL_NAMES and value is not None for name, value in bound.arguments.items())


def own_loss(output: Any, labelled: bool = False) -> torch.Tensor | None:
    """The loss a model computed itself, or None: its ``.loss`` (a transformers output), the
    output when it is one float element, or - where the call passed targets (``labelled``:
    ``given_labels``) - the one single-element float tensor of a tuple or list: karpathy's GPT
    returns ``(logits, loss)``, transformers without return_dict ``(loss, logits, ...)``. Without
    targets a lone scalar in a tuple may be an auxiliary loss (a router's), not the loss. A
    training check or an fp8 audit that took the first tensor trained the logits to a made-up
    target instead, with gradients that model never sees."""
    from torch import Tensor

    loss = getattr(output, "loss", None)
    if isinstance(loss, Tensor) and loss.numel() == 1:
        return loss
    if isinstance(output, Tensor):
        return output if output.is_floating_point() and output.numel() == 1 else None
    if labelled and isinstance(output, (tuple, list)):
        scalars = [t for t in output if isinstance(t, Tensor) and t.is_floating_point() and t.numel() == 1]
        if len(scalars) == 1:
            return scalars[0]
    return None


def linear_input(args: tuple, kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """An ``nn.Linear`` call's input tensor: ``fc(x)``, or ``fc(input=x)`` - nn.Linear.forward's
    parameter name, which a forward hook sees in kwargs, not args; None for any other call."""
    from torch import Tensor

    x = args[0] if args else kwargs.get("input")
    return x if isinstance(x, Tensor) and len(args) + len(kwargs) == 1 else None


def has_tensor(value: Any) -> bool:
    """Whether a (nested) output holds a tensor; dict subclasses such as HF's ModelOutput count."""
    return next(iter_tensors(value), None) is not None


def _walk(value: Any, tensor: type) -> Iterator[torch.Tensor]:
    if isinstance(value, tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _walk(item, tensor)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _walk(item, tensor)
