"""A deep copy of a user's model that ``copy.deepcopy`` alone refuses.

``torch.nn.utils.weight_norm`` (HiFi-GAN, VITS, BigVGAN, EnCodec) keeps each module's ``weight``
as a plain attribute computed from ``weight_g`` and ``weight_v``: a tensor with autograd history,
which ``copy.deepcopy`` will not copy ("Only Tensors created explicitly by the user (graph
leaves) support the deepcopy protocol"), from the moment the model is built. ``spectral_norm``
leaves one after a training forward, and so does any forward that caches an intermediate on
``self``. Such an attribute is a forward's by-product - weight_norm's pre-hook recomputes it
before every call - so the copy gets it detached, and the user's model keeps its own.
"""

from __future__ import annotations

import copy
from typing import TypeVar

import torch

M = TypeVar("M", bound=torch.nn.Module)


def copy_model(model: M) -> M:
    """``copy.deepcopy(model)``, with every module attribute that carries autograd history
    (not a parameter or buffer) copied detached."""
    held = [(module, name, value) for module in model.modules() for name, value in vars(module).items()
            if isinstance(value, torch.Tensor) and value.grad_fn is not None]
    try:
        for module, name, value in held:
            module.__dict__[name] = value.detach()
        return copy.deepcopy(model)
    finally:
        for module, name, value in held:
            module.__dict__[name] = value
