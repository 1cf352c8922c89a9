"""``ampaudit.watch`` as a Lightning callback::

    from ampaudit.integrations.lightning import AmpAuditCallback

    trainer = pl.Trainer(precision="bf16-mixed", callbacks=[AmpAuditCallback(log="run.jsonl")])
    trainer.fit(model, data)

It watches the LightningModule from ``on_train_start`` to ``on_train_end`` (or
``on_exception``), and ends each step at ``on_before_optimizer_step``: after the backward
(Lightning's automatic optimization runs it in the closure it hands ``optimizer.step``), after
the precision plugin's ``GradScaler.unscale_`` and before gradient clipping and the update - so
one step per optimizer step, gradient accumulation included, and with ``precision="16-mixed"``
the loss scale and the steps the scaler skips are recorded. Validation and sanity-check
forwards run without grad: counted, not recorded.

Lightning is imported when ``AmpAuditCallback`` is first used (``lightning.pytorch`` or
``pytorch_lightning``, whichever the program uses); without either, a one-line error names the
pip command.
"""

from __future__ import annotations

from typing import Any

from ampaudit.integrations import lazy_class

_NEEDS = ('ampaudit.integrations.lightning needs Lightning: pip install "ampaudit[lightning]" '
          "(or pip install pytorch-lightning)")


def _build() -> type:
    from ampaudit.integrations._common import WatchingCallback, end_step, require

    pl = require(("pytorch_lightning", "lightning.pytorch"), _NEEDS)

    class AmpAuditCallback(WatchingCallback, pl.Callback):
        """Watch the LightningModule while it trains: ``AmpAuditCallback(log=..., every=...,
        dtype=..., ...)`` or ``AmpAuditCallback(WatchOptions(...))`` takes ``ampaudit.watch``'s
        options (``guard``: the precision plugin's GradScaler); ``summary()``, ``print()`` and
        ``monitor`` read the run."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            # 16-mixed: the plugin's GradScaler, which unscales before on_before_optimizer_step; bf16: None
            self._scaler = getattr(trainer.precision_plugin, "scaler", None)
            self._start(pl_module, self._scaler)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self._running:
                end_step(self.monitor, self._scaler)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.close()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self.close()

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.close()

    AmpAuditCallback.__module__ = __name__
    return AmpAuditCallback


__getattr__ = lazy_class(__name__, "AmpAuditCallback", _build)
