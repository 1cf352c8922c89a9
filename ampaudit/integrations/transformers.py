"""``ampaudit.watch`` as a callback of the HF ``Trainer``::

    from ampaudit.integrations.transformers import AmpAuditCallback

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[AmpAuditCallback(log="run.jsonl")])
    trainer.train()

It watches the model from ``on_train_begin`` to ``on_train_end`` and ends each step at
``on_pre_optimizer_step``: once per optimizer step (``state.global_step``), after the
micro-batches of gradient accumulation and after gradient clipping, before the update. With
fp16 the Trainer's optimizer carries Accelerate's GradScaler: the callback unscales the
gradients first unless clipping already did (the call ``GradScaler.step`` would make itself,
so training does not change), which records the unscaled gradients, the loss scale and the
steps the scaler skips. Evaluation runs without grad: counted, not recorded.

The Trainer calls no callback when ``train()`` raises: the log holds every finished step, and
``callback.close()`` removes the hooks (the next ``train()`` also does).

transformers is imported when ``AmpAuditCallback`` is first used; without it, a one-line error
names the pip command.
"""

from __future__ import annotations

from typing import Any

from ampaudit.integrations import lazy_class

_NEEDS = ('ampaudit.integrations.transformers needs transformers: pip install "ampaudit[transformers]" '
          "(or pip install transformers)")


def _build() -> type:
    from ampaudit.integrations._common import WatchingCallback, end_step, require, unscale_once

    transformers = require(("transformers",), _NEEDS)
    if not hasattr(transformers.TrainerCallback, "on_pre_optimizer_step"):  # added in 4.45
        raise ImportError(f"ampaudit.integrations.transformers needs transformers>=4.45 (found "
                          f"{transformers.__version__}): pip install -U transformers")

    class AmpAuditCallback(WatchingCallback, transformers.TrainerCallback):
        """Watch the Trainer's model while it trains: ``AmpAuditCallback(log=..., every=...,
        dtype=..., ...)`` or ``AmpAuditCallback(WatchOptions(...))`` takes ``ampaudit.watch``'s
        options (``guard``: Accelerate's GradScaler, with fp16); ``summary()``, ``print()`` and
        ``monitor`` read the run, ``close()`` ends it after ``train()`` raised."""

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                           **kwargs: Any) -> None:
            # with fp16, the prepared optimizer (Accelerate's AcceleratedOptimizer) carries the GradScaler
            self._start(model, getattr(optimizer, "scaler", None), getattr(optimizer, "optimizer", optimizer))

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                                  **kwargs: Any) -> None:
            if not self._running:
                return
            scaler = getattr(optimizer, "scaler", None)  # Accelerate's AcceleratedOptimizer, with fp16
            if scaler is not None:
                unscale_once(scaler, getattr(optimizer, "optimizer", optimizer))
            try:
                end_step(self.monitor, scaler)
            except BaseException:  # stop_on_nonfinite: the Trainer calls no callback on the way out
                self.close()
                raise

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.close()

    AmpAuditCallback.__module__ = __name__
    return AmpAuditCallback


__getattr__ = lazy_class(__name__, "AmpAuditCallback", _build)
