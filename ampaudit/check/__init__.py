"""Pillar 1, ``ampaudit check``: audit a model before enabling AMP, and lint training scripts.

``ampaudit.check`` is both this package and the API function :func:`ampaudit.check.api.check`
(see ampaudit/core/callable_package.py).
"""

from ampaudit.core.callable_package import make_callable

make_callable(__name__, "ampaudit.check.api", "check")
