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
steps recorded are exactly the ``every``-th ones, as before.
"""

from __future__ import annotations

from collections.abc import Hashable


class EverySchedule:
    def __init__(self, every: int) -> None:
        self.every = every
        self._counts: dict[Hashable, int] = {}  # steps each ender ended so far

    def due(self, ender: Hashable) -> bool:
        """Whether ``ender``'s step now is one to record."""
        return self._counts.get(ender, 0) % self.every == 0

    def ended(self, ender: Hashable) -> None:
        self._counts[ender] = self._counts.get(ender, 0) + 1

    def arm_next(self) -> bool:
        """Whether the next step is recorded: some ender is due (or none has stepped yet)."""
        return not self._counts or any(n % self.every == 0 for n in self._counts.values())
