"""Which steps a watch records when ``every`` > 1: every ``every``-th step *of each optimizer*
that ends steps.

``ampaudit run`` ends a watched step at each optimizer's ``step()``: a GAN's discriminator and
generator take turns, and counting their steps together, an even ``every`` would record only one
of them (measured: with two optimizers and ``every=2`` the second's parameter gradients were in
no logged step). So each step's ender - the optimizer that stepped, or the GradScaler whose
``update()`` ended it, or ``None`` for a step ended by hand - keeps its own count. The hooks are
armed for the next step while any ender is due, since which one steps next is not known then;
a step recorded for an ender that turns out not due is dropped at its boundary (a GAN with
``every=10``: about one step in twenty). With one ender the counts are the step numbers: the
steps recorded are exactly the ``every``-th ones. An ender that dies leaves its count to the
next new one: a sweep's next trial, or an optimizer built each step, goes on every ``every``-th
step, and a dead one's count never keeps the hooks armed.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any

_NEW = object()  # an ender not seen before (or a dead one's id, now another object's)


class EverySchedule:
    def __init__(self, every: int) -> None:
        self.every = every
        self._counts: dict[Hashable, int] = {}  # steps each live ender ended so far, by key (``_known``)
        self._refs: dict[int, weakref.ref] = {}  # the enders that can die (optimizers, GradScalers), by id
        # the count of the last ender that died, which the next new one goes on from: an optimizer
        # made anew (a sweep's next trial, one built each step) continues the schedule
        self._orphan: int | None = None

    def due(self, ender: Any) -> bool:
        """Whether ``ender``'s step now is one to record."""
        return self._count(ender) % self.every == 0

    def ended(self, ender: Any) -> None:
        key = self._known(ender)
        count = None if key is _NEW else self._counts.get(key)
        if count is None:  # a new ender: it takes over a dead one's count, if any
            count, self._orphan = self._orphan or 0, None
            if key is _NEW:
                key = self._register(ender)
        self._counts[key] = count + 1

    def arm_next(self) -> bool:
        """Whether the next step is recorded: some live ender is due, or a new one would be (none
        has stepped yet, or one that died left a due count). A dead ender's count is forgotten:
        kept, one whose count was a multiple of ``every`` armed every later step."""
        counts = [*self._counts.values(), *([] if self._orphan is None else [self._orphan])]
        return not counts or any(n % self.every == 0 for n in counts)

    def _count(self, ender: Any) -> int:
        key = self._known(ender)
        if key is not _NEW and key in self._counts:
            return self._counts[key]
        return self._orphan or 0

    def _known(self, ender: Any) -> Hashable:
        """``ender``'s key: itself where it cannot die (None: a step ended by hand), else its id
        while the object registered under that id lives (an id outlives its object)."""
        if not type(ender).__weakrefoffset__:
            return ender
        ref = self._refs.get(id(ender))
        return id(ender) if ref is not None and ref() is ender else _NEW

    def _register(self, ender: Any) -> int:
        key = id(ender)
        self._counts.pop(key, None)  # a dead ender's, whose callback has not run yet
        self._refs[key] = weakref.ref(ender, lambda _, key=key: self._died(key))
        return key

    def _died(self, key: int) -> None:
        self._refs.pop(key, None)
        count = self._counts.pop(key, None)
        if count is not None:
            self._orphan = count
