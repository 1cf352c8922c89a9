"""The memory the loss probe's kept calls hold, in bytes: what bounds them besides their count.

A kept call (``loss_probe``) holds the tensors it read and made until the step's end - past the
backward that frees them without the probe, into the optimizer's step. Counted here: the
storages those tensors hold that the loss code made (the output of some call the probe saw this
step), each once however many kept calls and views hold it; not those that were there before the
loss code (the model's output, the labels, a view of them, an in-place op on them), which the step
holds anyway until its backward. A storage made by a call dropped since, that a kept call read, is
still held, and still counted (a storage of this step's made ones freed since, whose address a
later tensor from before the loss code takes, counts too: more is dropped, never less). The
probe drops its oldest calls while the count is over the budget: a call whose own storages alone
are over it is not kept at all.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ampaudit.core.tensors import iter_tensors

MB = 1 << 20

# (device, data pointer) of a storage, or the id of a tensor that has none (sparse): its size in bytes
Storages = dict[tuple, int]


def storages(value: Any) -> Storages:
    """The distinct storages the tensors in ``value`` hold, with their sizes in bytes."""
    found: Storages = {}
    for tensor in iter_tensors(value):
        try:
            storage = tensor.untyped_storage()
            found[(tensor.device, storage.data_ptr())] = storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):  # no storage: sparse, nested, a subclass's
            found[(id(tensor),)] = tensor.nelement() * tensor.element_size()
    return found


class ByteBudget:
    """The bytes of the loss code's storages the kept calls hold, against ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0  # bytes the kept calls hold, as counted above
        self._made: set[tuple] = set()  # storages some call of this step made
        self._refs: Counter[tuple] = Counter()  # per counted storage, the kept calls that hold it
        self._sizes: dict[tuple, int] = {}

    def add(self, read: Any, made: Any) -> tuple[tuple, ...]:
        """A call that read ``read`` and returned ``made`` is kept: the storages counted for it."""
        before = storages(read)
        after = storages(made)
        # a storage in the output that was not among the inputs was made by the call
        self._made.update(key for key in after if key not in before)
        held = {**before, **after}
        counted = tuple(key for key in held if key in self._made)
        for key in counted:
            if not self._refs[key]:
                self._sizes[key] = held[key]
                self.held += held[key]
            self._refs[key] += 1
        return counted

    def drop(self, counted: tuple[tuple, ...]) -> None:
        """A kept call dropped: its storages no longer counted where no other kept call holds them."""
        for key in counted:
            self._refs[key] -= 1
            if not self._refs[key]:
                del self._refs[key]
                self.held -= self._sizes.pop(key)

    def over(self) -> bool:
        return self.held > self.limit

    def clear(self) -> None:
        """The step ended: its calls released."""
        self.held = 0
        self._made.clear()
        self._refs.clear()
        self._sizes.clear()
