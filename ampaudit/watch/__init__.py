"""Pillar 3, ``ampaudit watch``: runtime hooks that find where mixed-precision training goes
wrong - per-layer NaN/Inf/overflow/underflow counts, gradient magnitudes, the loss scale,
and the first module to go non-finite - at about one host sync per step.

``ampaudit.watch`` is both this package and the API function :func:`ampaudit.watch.monitor.watch`
(see ampaudit/core/callable_package.py).
"""

from ampaudit.core.callable_package import make_callable

make_callable(__name__, "ampaudit.watch.monitor", "watch")
