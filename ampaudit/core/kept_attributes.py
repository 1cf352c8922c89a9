"""Every run ampaudit makes of a user's model leaves the model's attributes as it found them.

Forwards assign attributes: the Annotated Transformer keeps ``self.attn = p_attn``, Meta's
llama reassigns ``self.cache_k = self.cache_k.to(xq)`` and ``self.freqs_cis``. Left behind by
an fx trace they are Proxies (the next run feeds them to an ``assert`` and fails), by the
float64 recording float64 tensors, by a run with autograd non-leaf tensors (``copy.deepcopy``
of the model then raises). So each run restores every module's ``__dict__`` entries and its
parameter, buffer and submodule tables to the very objects they held before (values by
identity; a tensor's contents written in place are the forward's own business). A plain dict or
list attribute the forward fills in place is a cache: timm's LeViT keeps its gathered attention
biases in ``attention_bias_cache`` in eval mode, where a run with autograd left a tensor of that
run's graph for the next run's backward ("backward through the graph a second time"). Its
entries are put back as they were too. Watch's replays of a module (``watch/provenance.py``) keep
them the same way: a forward that counts its calls in an attribute must not count a replay.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # core imports no torch: the lint path stands on it
    import torch

_TABLES = ("_parameters", "_buffers", "_modules")


@contextlib.contextmanager
def attributes_kept(*roots: torch.nn.Module) -> Iterator[None]:
    """Restore the attributes of every module under ``roots`` when the block ends."""
    modules = list({id(m): m for root in roots for m in root.modules()}.values())
    saved = [(m, dict(m.__dict__), [dict(m.__dict__.get(t) or {}) for t in _TABLES]) for m in modules]
    contents = [(value, copy.copy(value)) for m in modules for name, value in m.__dict__.items()
                if type(value) in (dict, list) and name not in _TABLES]
    try:
        yield
    finally:
        for module, attributes, tables in saved:
            _restore(module.__dict__, attributes)
            for name, table in zip(_TABLES, tables, strict=True):
                current = module.__dict__.get(name)
                if isinstance(current, dict) and not _same(current, table):
                    current.clear()
                    current.update(table)
        for container, items in contents:
            _refill(container, items)


def _restore(current: dict, saved: dict) -> None:
    for key in [k for k in current if k not in saved]:
        del current[key]
    for key, value in saved.items():
        if current.get(key, _MISSING) is not value:
            current[key] = value


def _refill(container: dict | list, items: dict | list) -> None:
    """``container`` holds ``items`` again, by identity, in place."""
    if isinstance(container, dict):
        if not _same(container, items):
            container.clear()
            container.update(items)
    elif len(container) != len(items) or any(a is not b for a, b in zip(container, items, strict=False)):
        container[:] = items


def _same(current: dict, saved: dict) -> bool:
    return current.keys() == saved.keys() and all(current[k] is v for k, v in saved.items())


_MISSING = object()
