"""Log lines third-party libraries write as they import, which are not about the user's model:
torchao 0.18 logs "Failed to load .../_C_mxfp8...so" for each CUDA kernel library a CPU
machine cannot load, and torch warns that torchao registers its Enums with pytree the old way.
transformers imports torchao while it builds a model, so with ``ampaudit[fp8]`` installed every
``check hf:...`` printed four such lines. ampaudit's commands quiet them while they import and
build the user's model; the user's own code running afterwards logs as usual.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

NOISY = ("torchao", "torch.utils._pytree")  # logger names


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Only errors from the NOISY loggers while the block runs; their levels restored after."""
    loggers = [logging.getLogger(name) for name in NOISY]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
