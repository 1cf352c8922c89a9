"""``ampaudit.watch`` for a training loop that uses Accelerate::

    from ampaudit.integrations.accelerate import watch

    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    with watch(accelerator, model, optimizer, log="run.jsonl") as mon:
        for batch in data:
            loss = ...
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

The same Monitor as ``ampaudit.watch(accelerator.unwrap_model(model), optimizer=optimizer.optimizer,
scaler=accelerator.scaler)``: names relative to the user's model (no DDP ``module.``), and step
boundaries from the torch optimizer inside Accelerate's wrapper - which steps only when
gradients sync, so one step per real optimizer step under ``accelerator.accumulate`` - or, with
fp16 and Accelerate's GradScaler, from ``scaler.update()``, so skipped steps are recorded
and the gradients are read unscaled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ampaudit.watch.monitor import Monitor
    from ampaudit.watch.options import WatchOptions

_NEEDS = ('ampaudit.integrations.accelerate needs accelerate: pip install "ampaudit[accelerate]" '
          "(or pip install accelerate)")


def watch(accelerator: Any, model: Any, optimizer: Any = None, *, options: WatchOptions | None = None,
          **keywords: Any) -> Monitor:
    """A Monitor (not started: use it as a context manager, or ``start()``/``stop()``) on the
    prepared ``model`` and ``optimizer`` of ``accelerator``, with ``ampaudit.watch``'s options:
    ``options=WatchOptions(...)``, or its fields as keyword arguments (``log``, ``every``,
    ``dtype``, ``stop_on_nonfinite``, ...)."""
    from ampaudit.integrations._common import require
    from ampaudit.watch.monitor import Monitor
    from ampaudit.watch.options import resolve

    caller = "ampaudit.integrations.accelerate.watch()"
    accelerate = require(("accelerate",), _NEEDS)
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(f"{caller} takes an accelerate.Accelerator, not {type(accelerator).__name__}")
    if "scaler" in keywords:
        raise TypeError(f"{caller} takes the GradScaler from the accelerator")
    resolved = resolve(options, keywords, caller=caller)
    if resolved.guard not in (False, None) and accelerator.scaler is None:
        raise ValueError("guard needs the GradScaler that skips steps, and this accelerator has none "
                         "(it has one with mixed_precision=\"fp16\")")
    inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the torch optimizer
    return Monitor(accelerator.unwrap_model(model), optimizer=inner, scaler=accelerator.scaler, options=resolved)
