"""``ampaudit.watch`` inside the trainers people already use - each module imports its
framework only when its API is first used, so importing this package costs nothing:

- ``ampaudit.integrations.lightning.AmpAuditCallback``: a Lightning ``Callback``
  (``pip install "ampaudit[lightning]"``);
- ``ampaudit.integrations.transformers.AmpAuditCallback``: a ``TrainerCallback`` for the HF
  ``Trainer`` (``pip install "ampaudit[transformers]"``);
- ``ampaudit.integrations.accelerate.watch(accelerator, model, optimizer)``: a watch for a
  loop that uses ``accelerator.backward`` (``pip install "ampaudit[accelerate]"``).

Each returns or holds an ordinary ``ampaudit.watch`` Monitor: the same statistics, log and
``summary()``; only where a step ends comes from the trainer. See docs/watch.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def lazy_class(module: str, name: str, build: Callable[[], type]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that builds class ``name`` (which subclasses the framework's
    callback) on first use and keeps it in the module."""

    def __getattr__(attribute: str) -> Any:
        if attribute == name:
            cls = build()
            setattr(sys.modules[module], name, cls)
            return cls
        raise AttributeError(f"module {module!r} has no attribute {attribute!r}")

    return __getattr__
