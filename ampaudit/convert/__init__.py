"""Pillar 2, ``ampaudit convert``: rewrite a model into explicit mixed precision, with fp32
master weights and loss scaling in the returned optimizer.

``ampaudit.convert`` is both this package and the API function :func:`ampaudit.convert.api.convert`
(see ampaudit/core/callable_package.py).
"""

from ampaudit.core.callable_package import make_callable

make_callable(__name__, "ampaudit.convert.api", "convert")
