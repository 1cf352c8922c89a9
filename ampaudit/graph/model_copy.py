"""A deep copy of a user's model that ``copy.deepcopy`` alone refuses.

``torch.nn.utils.weight_norm`` (HiFi-GAN, VITS, BigVGAN, EnCodec) keeps each module's ``weight``
as a plain attribute computed from ``weight_g`` and ``weight_v``: a tensor with autograd history,
which ``copy.deepcopy`` will not copy ("Only Tensors created explicitly by the user (graph
leaves) support the deepcopy protocol"), from the moment the model is built. ``spectral_norm``
leaves one after a training forward, and so does any forward that caches an intermediate on
``self``. Such an attribute is a forward's by-product - weight_norm's pre-hook recomputes it
before every call - so the copy gets it detached, and the user's model keeps its own.

A method bound on the instance to the module itself (the modules backend's ``forward``
wrapper, accelerate's hooks) is taken off while the copy is made and bound to the copy's
module after: a class whose ``__reduce__`` passes its state as the reconstructor's arguments
(StyleGAN's and EDM2's ``persistence.persistent_class``) copies that state before the copy
exists, so the method's ``__self__`` led back to the module without end (RecursionError).

What convert sets on a module (``ampaudit_fp32_ops``, ...) goes with it into the copy and the
pickle even where the class's state leaves it out: einops' ``Rearrange`` and ``Reduce`` layers
pickle their pattern alone and run ``__init__`` again on load, so a copy of a converted MaxViT
lost its leaves' ``ampaudit_fp32_ops`` while keeping the forward that reads it (AttributeError).
"""

from __future__ import annotations

import copy
import types
from typing import Any, TypeVar

import torch

M = TypeVar("M", bound=torch.nn.Module)


def copy_model(model: M, memo: dict[int, object] | None = None) -> M:
    """``copy.deepcopy(model, memo)``, with every module attribute that carries autograd history
    (not a parameter or buffer) copied detached."""
    modules = list(model.modules())
    held = [(module, name, value) for module in modules for name, value in vars(module).items()
            if isinstance(value, torch.Tensor) and value.grad_fn is not None]
    bound = [(i, name, value) for i, module in enumerate(modules) for name, value in _self_bound(module).items()]
    memo = {} if memo is None else memo
    try:
        for module, name, value in held:
            module.__dict__[name] = value.detach()
        for i, name, _ in bound:
            del modules[i].__dict__[name]
        copied = copy.deepcopy(model, memo)
    finally:
        for module, name, value in held:
            module.__dict__[name] = value
        for i, name, value in bound:
            modules[i].__dict__[name] = value
    copies = list(copied.modules())
    for i, name, value in bound:
        copies[i].__dict__[name] = types.MethodType(value.__func__, copies[i])
    for module, twin in zip(modules, copies, strict=True):
        for name, value in _carried(module).items():
            if name not in twin.__dict__:  # the class's own state left it out
                twin.__dict__[name] = copy.deepcopy(value, memo)
    return copied


def copied_whole(module: torch.nn.Module) -> None:
    """Have ``copy.deepcopy(module)`` - the user's: an EMA of the converted model - be
    ``copy_model``'s, for a module given a method bound to itself: an instance ``__deepcopy__``
    (itself bound, so taken off and bound again like the others). Without it a persistent
    class's copy recursed, as above. And a pickle of it (``torch.save(model)``, EDM2's network
    snapshots) ``_pickled``'s: a bound method pickles as ``getattr(module, name)``, which the
    load runs before the module has its attributes (AttributeError), and inside a persistent
    class's state it recursed."""
    module.__deepcopy__ = types.MethodType(_deepcopy, module)
    module.__reduce_ex__ = types.MethodType(_pickled, module)


def _deepcopy(self: torch.nn.Module, memo: dict[int, object]) -> torch.nn.Module:
    return copy_model(self, memo)


def _self_bound(module: torch.nn.Module) -> dict[str, types.MethodType]:
    """The methods bound to ``module`` itself that its instance holds, by attribute name."""
    return {name: value for name, value in vars(module).items()
            if isinstance(value, types.MethodType) and value.__self__ is module}


def _carried(module: torch.nn.Module) -> dict[str, Any]:
    """What convert set on ``module`` (``ampaudit_`` names), but for methods bound to it."""
    return {name: value for name, value in vars(module).items()
            if name.lstrip("_").startswith("ampaudit_")
            and not (isinstance(value, types.MethodType) and value.__self__ is module)}


def _pickled(self: torch.nn.Module, protocol: int) -> tuple:
    """The class's own pickle of the module (a persistent class's too) made with its methods
    bound to itself taken off; the load binds their functions (module-level: pickled by name)
    to the module as soon as it is made - before its state, which does not hold them. No
    state setter: ``copy.copy`` asks this too, and takes at most five fields."""
    bound = _self_bound(self)
    for name in bound:
        del self.__dict__[name]
    try:  # the class's: nn.Module's state is a copy of the attributes, without them
        fields = type(self).__reduce_ex__(self, protocol)
    finally:
        self.__dict__.update(bound)
    functions = [(name, method.__func__) for name, method in bound.items()]
    return (_made_and_bound, (fields[0], fields[1], functions, _carried(self)), *fields[2:])


def _made_and_bound(make: Any, args: tuple, functions: list[tuple[str, Any]],
                    carried: dict[str, Any] | None = None) -> torch.nn.Module:
    """The class's reconstructor's module, given its methods bound to itself again and what
    convert set on it (before its state, which may hold them too, or not)."""
    module = make(*args)
    module.__dict__.update(carried or {})
    for name, function in functions:
        module.__dict__[name] = types.MethodType(function, module)
    return module
