"""ampaudit.integrations under the real frameworks, on the CPU with tiny models: Lightning's
callback, the HF Trainer's callback and the Accelerate helper each count exactly one step per
optimizer step, find an injected non-finite value at its step and module, record the steps a
GradScaler skips, write the log, and leave training bit-identical.

Each framework's tests skip when it is not installed (the dev extra installs all three). On the
CPU, fp16 autocast with a GradScaler is not what the frameworks set up by themselves (Lightning
turns ``precision="16-mixed"`` into bf16, Accelerate and the Trainer train fp16 in fp32): the
fp16 tests give them a CPU GradScaler the way their GPU path holds one - Lightning's
``MixedPrecision("16-mixed", "cpu", scaler)`` plugin, and ``accelerator.scaler`` with
``accelerator.native_amp`` for Accelerate and the Trainer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import ampaudit
from ampaudit.integrations import _common
from ampaudit.watch.monitor import NonFiniteError
from ampaudit.watch.options import WatchOptions
from ampaudit.watch.summary import read_log
from tests.conftest import ROOT
from tests.test_watch_options import EFFECTS, EXPECTED, samples

INF = float("inf")


def _where(first):
    """Where the first non-finite value was seen (its op and note, when known, aside)."""
    return None if first is None else {k: first[k] for k in ("step", "module", "phase", "tensor")}
FRAMEWORKS = ("pytorch_lightning", "lightning", "lightning.pytorch", "transformers", "accelerate")


def _records(log):
    """The log's per-step records (the header and the final scale left out)."""
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return [r for r in lines if "step" in r]


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _no_hooks(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.fixture(autouse=True)
def _leave_no_framework_state():
    """Accelerate keeps one process-wide state (its mixed precision among it), and the frameworks
    set environment variables: each test here leaves neither behind."""
    environ = dict(os.environ)
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)


# --------------------------------------------------------------------------- no framework needed


def test_importing_the_integrations_imports_no_framework():
    code = ("import sys\nimport ampaudit.integrations, ampaudit.integrations.lightning, "
            "ampaudit.integrations.transformers, ampaudit.integrations.accelerate\n"
            f"print(sorted(m for m in {('torch', *FRAMEWORKS)!r} if m in sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(("module", "pip"), [("lightning", "ampaudit[lightning]"),
                                             ("transformers", "ampaudit[transformers]"),
                                             ("accelerate", "ampaudit[accelerate]")])
def test_a_missing_framework_is_a_one_line_error_naming_pip(monkeypatch, module, pip):
    for name in FRAMEWORKS:
        monkeypatch.setitem(sys.modules, name, None)  # "not installed", whatever is
    integration = __import__(f"ampaudit.integrations.{module}", fromlist=["_"])
    with pytest.raises(ModuleNotFoundError) as err:
        integration._build() if module != "accelerate" else integration.watch(object(), nn.Linear(1, 1))
    message = str(err.value)
    assert "\n" not in message and f'pip install "{pip}"' in message, message
    assert message.startswith(f"ampaudit.integrations.{module} needs ")


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adamw"])
def test_unscale_once_unscales_as_the_scaler_step_would(fused):
    # fused AdamW (the HF Trainer's default) unscales inside its own step unless unscale_ ran first
    def train(extra_unscale: bool) -> dict:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True) if fused else \
            torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(3, 4)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            if extra_unscale:
                _common.unscale_once(scaler, opt)
                _common.unscale_once(scaler, opt)  # already unscaled this step: nothing happens
            scaler.step(opt)
            scaler.update()
        return model.state_dict()

    assert _same_weights(train(False), train(True))


# --------------------------------------------------------------------------- Lightning

BATCH = 4


def _lightning():
    return pytest.importorskip("pytorch_lightning", reason="pip install pytorch-lightning")


def _lit_module(pl, bad_batch: int | None = None, scheduler: bool = False):
    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx == bad_batch:
                x = x.clone()
                x[0, 0] = INF  # one bad sample
            return (self(x) - y).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            x, y = batch
            return (self(x) - y).pow(2).mean()

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
            if not scheduler:
                return opt
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    torch.manual_seed(0)
    return Net()


def _lit_data(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=BATCH)


def _fit(pl, precision: str, callbacks=(), *, steps: int, accumulate: int = 1, bad_batch: int | None = None,
         validate: bool = False, init_scale: float = 2.0**16, scheduler: bool = False):
    """Fit the tiny module for ``steps`` optimizer steps in one epoch; "16-mixed" is fp16
    autocast with a CPU GradScaler (Lightning's own plugin, given the scaler)."""
    if precision == "16-mixed":
        from pytorch_lightning.plugins.precision import MixedPrecision

        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        kwargs = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    else:
        kwargs = {"precision": precision}
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=accumulate,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=list(callbacks),
                         val_check_interval=2 if validate else None, num_sanity_val_steps=2 if validate else 0,
                         limit_val_batches=2 if validate else 0, **kwargs)
    module = _lit_module(pl, bad_batch, scheduler)
    trainer.fit(module, _lit_data(), _lit_data(16) if validate else None)
    return trainer, module


def test_lightning_every_2_records_steps_0_and_2_and_still_counts_every_validation_call():
    # between recorded steps the module hooks are off (the root's stays): validation forwards
    # in any step are still counted, and the recorded steps' statistics are complete
    pl = _lightning()
    from ampaudit.integrations.lightning import AmpAuditCallback

    callback = AmpAuditCallback(every=2)
    trainer, module = _fit(pl, "bf16-mixed", [callback], steps=3, accumulate=2, validate=True)
    summary = callback.summary()
    assert summary["steps"] == trainer.global_step == 3
    assert summary["eval_forwards"] == {"count": 3 * 2, "recorded": False}
    assert summary["layers"]["net.0"]["forward"]["numel"] == 2 * 2 * BATCH * 8  # steps 0 and 2, both micro-batches
    assert not any(m._forward_hooks for m in module.modules())  # all off after the fit


def _weights_callback(pl):
    """An independent record of each step: the loss scale it used, and whether it moved the weights."""

    class Weights(pl.Callback):
        def __init__(self):
            self.before, self.moved, self.scales = None, [], []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            self.scales.append(scaler.get_scale() if scaler is not None else None)
            self.before = [p.detach().clone() for p in module.parameters()]

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            after = list(module.parameters())
            self.moved.append(not all(torch.equal(a, b) for a, b in zip(self.before, after, strict=True)))

    return Weights()


def test_lightning_counts_optimizer_steps_detects_bf16_and_leaves_out_validation(tmp_path):
    pl = _lightning()
    from ampaudit.integrations.lightning import AmpAuditCallback

    log = tmp_path / "run.jsonl"
    callback = AmpAuditCallback(log=log)
    trainer, _ = _fit(pl, "bf16-mixed", [callback], steps=3, accumulate=2, validate=True)
    summary = callback.summary()
    assert summary["steps"] == trainer.global_step == 3  # optimizer steps, not the 6 batches
    assert (summary["dtype"], summary["dtype_source"]) == ("bfloat16", "autocast (cpu)")
    assert summary["layers"]["net.0"]["forward"]["numel"] == 3 * 2 * BATCH * 8  # every micro-batch
    assert summary["first_nonfinite"] is None and summary["scaler"] is None
    # validation ran (2 batches after every 2nd training batch: 3 times), counted but not
    # recorded: the statistics are the same as without it
    assert summary["eval_forwards"] == {"count": 3 * 2, "recorded": False}
    plain = AmpAuditCallback()
    _fit(pl, "bf16-mixed", [plain], steps=3, accumulate=2)
    assert plain.summary()["layers"] == summary["layers"]
    assert plain.summary()["params"] == summary["params"]
    assert all(set(phases) == {"forward", "backward"} for phases in summary["layers"].values())
    # the log: one record per step, and the same summary read back
    assert [r["step"] for r in _records(log)] == [0, 1, 2]
    assert read_log(log).summary()["layers"] == summary["layers"]
    # the validation after the last step too: the log's end carries it (it said 4 of 6)
    assert read_log(log).summary()["eval_forwards"] == summary["eval_forwards"]
    assert _no_hooks(trainer.lightning_module)


def test_lightning_finds_the_bad_batch_at_its_step(tmp_path):
    pl = _lightning()
    from ampaudit.integrations.lightning import AmpAuditCallback

    log = tmp_path / "run.jsonl"
    callback = AmpAuditCallback(log=log)
    _fit(pl, "bf16-mixed", [callback], steps=8, bad_batch=5)
    expected = {"step": 5, "module": "net.0", "phase": "forward", "tensor": "output"}
    assert _where(callback.summary()["first_nonfinite"]) == expected
    assert callback.summary()["steps"] == 8
    firsts = [r["first_nonfinite"] for r in _records(log)]
    assert firsts[:5] == [None] * 5 and _where(firsts[5]) == expected


def test_lightning_under_run_blames_the_root_modules_own_line(tmp_path):
    # `ampaudit run` (global optimizer hooks) on Lightning's automatic optimization, which
    # steps with a closure: the NaN made in the LightningModule's own forward is named at its
    # line, not blamed on its first child as "came from outside" (replayed with updated weights)
    pl = _lightning()
    from ampaudit.watch.monitor import Monitor

    class Root(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 1)

        def forward(self, x):
            h = self.fc1(x)
            if self.global_step == 3:
                h = h / 0.0 * 0.0  # the root's own code
            return self.fc2(h)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return (self(x) - y).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    trainer = pl.Trainer(max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    with Monitor(None) as monitor:
        trainer.fit(Root(), _lit_data())
    first = monitor.summary()["first_nonfinite"]
    line = Root.forward.__code__.co_firstlineno + 3
    assert (first["step"], first["module"], first["op"]) == (3, "(model)", "aten.div")
    assert first["source"] == f"{__file__}:{line}"


@pytest.mark.parametrize("init_scale", [2.0**4, 2.0**16], ids=["low-scale", "default-scale"])
def test_lightning_16_mixed_records_the_steps_the_scaler_skips(tmp_path, init_scale):
    pl = _lightning()
    from ampaudit.integrations.lightning import AmpAuditCallback

    callback, weights = AmpAuditCallback(log=tmp_path / "run.jsonl"), _weights_callback(pl)
    trainer, _ = _fit(pl, "16-mixed", [weights, callback], steps=8, bad_batch=5, init_scale=init_scale)
    summary = callback.summary()
    skipped = [step for step, moved in enumerate(weights.moved) if not moved]  # the weights did not move
    assert summary["steps"] == trainer.global_step == 8  # a skipped step still counts
    assert summary["scaler"]["skipped_steps"] == skipped
    assert summary["scaler"]["history"] == [[step, scale] for step, scale in enumerate(weights.scales)]
    assert summary["scaler"]["scale"] == trainer.precision_plugin.scaler.get_scale()
    assert (summary["dtype"], summary["dtype_source"]) == ("float16", "autocast (cpu)")
    if init_scale == 2.0**4:  # nothing overflows but the bad batch
        assert skipped == [5]
        assert _where(summary["first_nonfinite"]) == {"step": 5, "module": "net.0", "phase": "forward",
                                                      "tensor": "output"}
    else:  # 2^16 overflows fp16 gradients first: the scaler's own skips, then the bad batch
        assert 5 in skipped and skipped[0] < 5
        assert summary["first_nonfinite"]["step"] == skipped[0]
        assert summary["first_nonfinite"]["phase"] == "backward"


def test_lightning_16_mixed_on_cpu_is_bf16_and_watch_says_so():
    pl = _lightning()
    from ampaudit.integrations.lightning import AmpAuditCallback

    callback = AmpAuditCallback()
    with pytest.warns(UserWarning, match="not supported on CPU"):
        trainer = pl.Trainer(accelerator="cpu", precision="16-mixed", max_steps=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[callback])
    trainer.fit(_lit_module(pl), _lit_data())
    assert callback.summary()["dtype"] == "bfloat16"
    assert callback.summary()["scaler"] is None


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_lightning_training_is_bit_identical_with_the_callback(tmp_path, precision):
    pl = _lightning()
    from ampaudit.integrations.lightning import AmpAuditCallback

    _, watched = _fit(pl, precision, [AmpAuditCallback(log=tmp_path / "run.jsonl")], steps=6, accumulate=2,
                      validate=True)
    _, plain = _fit(pl, precision, [], steps=6, accumulate=2, validate=True)
    assert _same_weights(watched.state_dict(), plain.state_dict())


def test_lightning_stop_on_nonfinite_raises_and_unhooks(tmp_path):
    pl = _lightning()
    from ampaudit.integrations.lightning import AmpAuditCallback

    log = tmp_path / "run.jsonl"
    callback = AmpAuditCallback(log=log, stop_on_nonfinite=True)
    trainer = pl.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=8, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback])
    module = _lit_module(pl, bad_batch=2)
    with pytest.raises(NonFiniteError, match=r"net\.0"):
        trainer.fit(module, _lit_data())
    assert _no_hooks(module)  # on_exception stopped the watch
    assert _records(log)[-1]["first_nonfinite"]["step"] == 2


def test_lightning_guard_guards_the_plugins_scaler(tmp_path):
    pl = _lightning()
    from ampaudit.integrations.lightning import AmpAuditCallback

    callback = AmpAuditCallback(guard=True)
    trainer, _ = _fit(pl, "16-mixed", [callback], steps=8, bad_batch=5, init_scale=2.0**4, scheduler=True)
    assert callback.summary()["guard"]["steps"] == 8
    assert callback.summary()["guard"]["skipped_steps"] == callback.summary()["scaler"]["skipped_steps"] == [5]
    assert callback.monitor.step_applied
    # guard=True finds the per-step scheduler Lightning steps: held on the skipped step (issue 28 item 10)
    assert callback.summary()["guard"]["scheduler_steps_held"] == 1
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.05 * 0.5**7
    with pytest.raises(ValueError, match="guard needs the GradScaler that skips steps, and this trainer runs without"):
        _fit(pl, "bf16-mixed", [AmpAuditCallback(guard=True)], steps=1)


def test_lightning_callback_checks_its_options_when_built():
    _lightning()
    from ampaudit.integrations.lightning import AmpAuditCallback

    with pytest.raises(ValueError, match="every"):
        AmpAuditCallback(every=0)
    with pytest.raises(RuntimeError, match="no training"):
        AmpAuditCallback().summary()


# --------------------------------------------------------------------------- HF transformers Trainer

SEQ, EMBD = 8, 16


def _transformers():
    return pytest.importorskip("transformers", minversion="4.45", reason="pip install 'transformers>=4.45'")


class _Tokens(Dataset):
    """Causal-LM samples: token ids that are their own labels."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = (torch.arange(SEQ) * (i + 1) + i) % 64
        return {"input_ids": ids, "labels": ids}


def _train_hf(tmp_path, mode: str = "bf16", callbacks=(), *, steps: int = 4, accumulate: int = 1,
              bad_call: int | None = None, evaluate: bool = False, init_scale: float = 2.0**8):
    """A 1-layer GPT-2 built from its config, trained by the Trainer on the CPU; "fp16" is fp16
    autocast with a CPU GradScaler in Accelerate's place for it. ``bad_call``: the first MLP's
    output becomes inf at that training forward (0-based)."""
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=EMBD, n_head=2, vocab_size=64, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    if bad_call is not None:
        calls = []

        def inject(module, args, output):
            if torch.is_grad_enabled():
                calls.append(1)
                if len(calls) == bad_call + 1:
                    return output * INF
            return None

        model.transformer.h[0].mlp.register_forward_hook(inject)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, max_steps=steps, per_device_train_batch_size=2,
        per_device_eval_batch_size=4, gradient_accumulation_steps=accumulate, learning_rate=1e-3, seed=0,
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        eval_strategy="steps" if evaluate else "no", eval_steps=1, bf16=mode == "bf16", fp16=mode == "fp16")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(32),
                                   eval_dataset=_Tokens(8) if evaluate else None, callbacks=list(callbacks))
    if mode == "fp16":  # what Accelerate sets up for fp16 on a GPU: autocast and its GradScaler
        trainer.accelerator.native_amp = True
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    trainer.train()
    return trainer, model


def _hf_steps_callback():
    """An independent record of each step: the loss scale it used and whether the scaler skipped
    it (its update() halved the scale). Not Accelerate's ``step_was_skipped``: with the Trainer's
    default fused AdamW the optimizer itself skips the update, and that flag stays False."""
    transformers = _transformers()

    class Steps(transformers.TrainerCallback):
        def __init__(self):
            self.scales, self.skipped = [], []

        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            self.scales.append(optimizer.scaler.get_scale())

        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            self.skipped.append(optimizer.scaler.get_scale() < self.scales[-1])

    return Steps()


def test_transformers_counts_optimizer_steps_detects_bf16_and_leaves_out_evaluation(tmp_path):
    _transformers()
    from ampaudit.integrations.transformers import AmpAuditCallback

    log = tmp_path / "run.jsonl"
    callback = AmpAuditCallback(log=log)
    trainer, model = _train_hf(tmp_path, "bf16", [callback], steps=3, accumulate=2, evaluate=True)
    summary = callback.summary()
    assert summary["steps"] == trainer.state.global_step == 3  # optimizer steps, not the 6 micro-batches
    assert (summary["dtype"], summary["dtype_source"]) == ("bfloat16", "autocast (cpu)")
    assert summary["layers"]["transformer.wte"]["forward"]["numel"] == 3 * 2 * 2 * SEQ * EMBD
    assert summary["first_nonfinite"] is None and summary["scaler"] is None
    assert summary["eval_forwards"] == {"count": 3 * 2, "recorded": False}  # 2 eval batches after each step
    plain = AmpAuditCallback()
    _train_hf(tmp_path, "bf16", [plain], steps=3, accumulate=2)
    assert plain.summary()["layers"] == summary["layers"]
    assert plain.summary()["params"] == summary["params"]
    assert [r["step"] for r in _records(log)] == [0, 1, 2]
    assert read_log(log).summary()["params"] == summary["params"]
    # the evaluation after the last step too: the log's end carries it (it said 4 of 6)
    assert read_log(log).summary()["eval_forwards"] == summary["eval_forwards"]
    assert _no_hooks(model)


def test_transformers_every_2_still_counts_every_evaluation_call(tmp_path):
    # steps 0 and 2 recorded; the evaluation after each step counted whether or not its step was
    _transformers()
    from ampaudit.integrations.transformers import AmpAuditCallback

    callback = AmpAuditCallback(every=2)
    trainer, model = _train_hf(tmp_path, "bf16", [callback], steps=3, accumulate=2, evaluate=True)
    summary = callback.summary()
    assert summary["steps"] == trainer.state.global_step == 3
    assert summary["eval_forwards"] == {"count": 3 * 2, "recorded": False}
    assert summary["layers"]["transformer.wte"]["forward"]["numel"] == 2 * 2 * 2 * SEQ * EMBD
    assert _no_hooks(model)


def test_transformers_finds_the_bad_forward_at_its_step(tmp_path):
    _transformers()
    from ampaudit.integrations.transformers import AmpAuditCallback

    log = tmp_path / "run.jsonl"
    callback = AmpAuditCallback(log=log)
    _train_hf(tmp_path, "bf16", [callback], steps=4, bad_call=2)
    expected = {"step": 2, "module": "transformer.h.0.mlp", "phase": "forward", "tensor": "output"}
    assert _where(callback.summary()["first_nonfinite"]) == expected
    assert [_where(r["first_nonfinite"]) for r in _records(log)][:3] == [None, None, expected]


def test_transformers_fp16_records_the_steps_the_scaler_skips(tmp_path):
    _transformers()
    from ampaudit.integrations.transformers import AmpAuditCallback

    callback, steps = AmpAuditCallback(log=tmp_path / "run.jsonl"), _hf_steps_callback()
    trainer, _ = _train_hf(tmp_path, "fp16", [steps, callback], steps=5, bad_call=3)
    summary = callback.summary()
    assert steps.skipped == [False, False, False, True, False]
    assert summary["steps"] == trainer.state.global_step == 5
    assert summary["scaler"]["skipped_steps"] == [3]
    assert summary["scaler"]["history"] == [[step, scale] for step, scale in enumerate(steps.scales)]
    assert _where(summary["first_nonfinite"]) == {"step": 3, "module": "transformer.h.0.mlp", "phase": "forward",
                                                  "tensor": "output"}
    assert (summary["dtype"], summary["dtype_source"]) == ("float16", "autocast (cpu)")


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_transformers_training_is_bit_identical_with_the_callback(tmp_path, mode):
    _transformers()
    from ampaudit.integrations.transformers import AmpAuditCallback

    _, watched = _train_hf(tmp_path, mode, [AmpAuditCallback(log=tmp_path / "run.jsonl")], steps=4, accumulate=2,
                           init_scale=2.0**16)
    _, plain = _train_hf(tmp_path, mode, [], steps=4, accumulate=2, init_scale=2.0**16)
    assert _same_weights(watched.state_dict(), plain.state_dict())


def test_transformers_stop_on_nonfinite_raises_and_unhooks(tmp_path):
    _transformers()
    from ampaudit.integrations.transformers import AmpAuditCallback

    callback = AmpAuditCallback(stop_on_nonfinite=True)
    with pytest.raises(NonFiniteError, match=r"transformer\.h\.0\.mlp"):
        _train_hf(tmp_path, "bf16", [callback], steps=4, bad_call=1)
    # the Trainer calls no callback when train() raises: the callback stopped its watch itself,
    # and only the test's own injecting hook is left
    model = callback.monitor.model
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 1


def test_transformers_guard_guards_accelerates_scaler(tmp_path):
    _transformers()
    from ampaudit.integrations.transformers import AmpAuditCallback

    callback = AmpAuditCallback(guard=True)
    _train_hf(tmp_path, "fp16", [callback], steps=5, bad_call=3)
    assert callback.summary()["guard"]["steps"] == 5
    assert callback.summary()["guard"]["skipped_steps"] == callback.summary()["scaler"]["skipped_steps"] == [3]


# --------------------------------------------------------------------------- Accelerate


def _accelerate():
    return pytest.importorskip("accelerate", reason="pip install accelerate")


def _train_accelerate(mode: str, *, micro_batches: int = 8, accumulate: int = 2, bad: int | None = None,
                      watch=None, init_scale: float = 2.0**4):
    """A loop with ``accelerator.accumulate``, ``accelerator.backward`` and the prepared optimizer;
    "fp16" is fp16 autocast with a CPU GradScaler in Accelerate's place. ``watch(accelerator,
    model, optimizer)`` returns the context to train in. Returns the model, the loop's result
    and, per optimizer step, the scale it used and whether Accelerate skipped it."""
    accelerate = _accelerate()
    accelerator = accelerate.Accelerator(mixed_precision="fp16" if mode == "fp16" else mode, cpu=True,
                                         gradient_accumulation_steps=accumulate)
    if mode == "fp16":  # what Accelerate sets up for fp16 on a GPU: autocast and its GradScaler
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1)
    scales, skipped = [], []
    context = watch(accelerator, model, optimizer) if watch is not None else None
    monitor = context.__enter__() if context is not None else None
    try:
        for i in range(micro_batches):
            x, y = torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 1, generator=g)
            if i == bad:
                x[0, 0] = INF
            with accelerator.accumulate(model):
                if accelerator.sync_gradients and accelerator.scaler is not None:
                    scales.append(accelerator.scaler.get_scale())
                loss = (model(x).float() - y).pow(2).mean()
                accelerator.backward(loss)
                optimizer.step()
                if accelerator.sync_gradients:
                    skipped.append(optimizer.step_was_skipped)
                optimizer.zero_grad()
    finally:
        if context is not None:
            context.__exit__(None, None, None)
    return model, monitor, scales, skipped


def test_accelerate_counts_optimizer_steps_with_the_users_names(tmp_path):
    _accelerate()
    from ampaudit.integrations.accelerate import watch

    log = tmp_path / "run.jsonl"
    model, mon, _, skipped = _train_accelerate("bf16", watch=lambda a, m, o: watch(a, m, o, log=log))
    summary = mon.summary()
    assert summary["steps"] == len(skipped) == 4  # 8 micro-batches, 2 per step
    assert (summary["dtype"], summary["dtype_source"]) == ("bfloat16", "autocast (cpu)")
    assert sorted(summary["layers"]) == ["(model)", "0", "1", "2"]
    assert summary["layers"]["0"]["forward"]["numel"] == 8 * BATCH * 8
    assert sorted(summary["params"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert [r["step"] for r in _records(log)] == [0, 1, 2, 3]
    assert read_log(log).summary()["layers"] == summary["layers"]
    assert _no_hooks(model)


def test_accelerate_plain_watch_with_the_inner_optimizer_is_the_same(tmp_path):
    _accelerate()
    import ampaudit
    from ampaudit.integrations.accelerate import watch

    _, helper, _, _ = _train_accelerate("fp16", bad=5, watch=watch)
    sys.modules["accelerate.state"].AcceleratorState._reset_state(True)
    _, plain, _, _ = _train_accelerate("fp16", bad=5, watch=lambda a, m, o: ampaudit.watch(
        a.unwrap_model(m), optimizer=o.optimizer, scaler=a.scaler))
    assert helper.summary() == plain.summary()


def test_accelerate_finds_the_bad_batch_at_its_step():
    _accelerate()
    from ampaudit.integrations.accelerate import watch

    _, mon, _, _ = _train_accelerate("bf16", bad=5, watch=watch)
    assert _where(mon.summary()["first_nonfinite"]) == {"step": 2, "module": "0", "phase": "forward",
                                                        "tensor": "output"}


@pytest.mark.parametrize("init_scale", [2.0**4, 2.0**16], ids=["low-scale", "default-scale"])
def test_accelerate_fp16_records_the_steps_the_scaler_skips(tmp_path, init_scale):
    _accelerate()
    from ampaudit.integrations.accelerate import watch

    _, mon, scales, skipped = _train_accelerate("fp16", micro_batches=12, bad=5, init_scale=init_scale,
                                                watch=lambda a, m, o: watch(a, m, o, log=tmp_path / "run.jsonl"))
    summary = mon.summary()
    assert summary["steps"] == 6
    assert summary["scaler"]["skipped_steps"] == [step for step, skip in enumerate(skipped) if skip]
    assert summary["scaler"]["history"] == [[step, scale] for step, scale in enumerate(scales)]
    assert 2 in summary["scaler"]["skipped_steps"]  # micro-batch 5 is in step 2
    if init_scale == 2.0**4:
        assert summary["scaler"]["skipped_steps"] == [2]
        assert _where(summary["first_nonfinite"]) == {"step": 2, "module": "0", "phase": "forward",
                                                      "tensor": "output"}
    assert (summary["dtype"], summary["dtype_source"]) == ("float16", "autocast (cpu)")


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_accelerate_training_is_bit_identical_with_watch(tmp_path, mode):
    _accelerate()
    from ampaudit.integrations.accelerate import watch

    watched, _, _, _ = _train_accelerate(mode, init_scale=2.0**16,
                                         watch=lambda a, m, o: watch(a, m, o, log=tmp_path / "run.jsonl"))
    sys.modules["accelerate.state"].AcceleratorState._reset_state(True)
    plain, _, _, _ = _train_accelerate(mode, init_scale=2.0**16)
    assert _same_weights(watched.state_dict(), plain.state_dict())


def test_accelerate_fp16_on_cpu_trains_fp32_and_watch_says_so():
    _accelerate()
    from ampaudit.integrations.accelerate import watch

    accelerate = sys.modules["accelerate"]
    accelerator = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    assert accelerator.scaler is None and not accelerator.native_amp  # Accelerate's own choice on the CPU
    model, optimizer = accelerator.prepare(nn.Linear(4, 2), torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1))
    with watch(accelerator, model, optimizer) as mon:
        accelerator.backward(model(torch.randn(3, 4)).sum())
        optimizer.step()
    assert mon.summary()["dtype_source"] == "default"  # no autocast: audited for float16 by default
    assert mon.summary()["steps"] == 1


def test_accelerate_watch_takes_an_accelerator():
    _accelerate()
    from ampaudit.integrations.accelerate import watch

    with pytest.raises(TypeError, match=r"accelerate\.Accelerator"):
        watch(object(), nn.Linear(1, 1))


def test_plain_watch_takes_accelerates_wrapped_optimizer():
    """``ampaudit.watch(model, optimizer=<AcceleratedOptimizer>)`` hooks the torch optimizer inside."""
    helper = _train_accelerate("bf16", watch=lambda acc, model, opt: ampaudit.watch(acc.unwrap_model(model),
                                                                                    optimizer=opt))
    plain = _train_accelerate("bf16", watch=lambda acc, model, opt: ampaudit.watch(acc.unwrap_model(model),
                                                                                   optimizer=opt.optimizer))
    assert helper[1].summary()["steps"] == 4
    assert helper[1].summary()["layers"] == plain[1].summary()["layers"]


def test_watch_refuses_what_is_not_an_optimizer():
    with pytest.raises(TypeError, match=r"must be a torch\.optim\.Optimizer \(got object\)"):
        ampaudit.watch(nn.Linear(2, 2), optimizer=object())



# --------------------------------------------------------------------------- every watch option


@pytest.mark.parametrize("framework", ["lightning", "transformers"])
def test_the_callbacks_take_every_watch_option(framework):
    (_lightning if framework == "lightning" else _transformers)()
    callback = __import__(f"ampaudit.integrations.{framework}", fromlist=["_"]).AmpAuditCallback
    given = samples()
    assert callback(**given).options == WatchOptions(**given)
    assert callback(WatchOptions(**given), every=7).options == WatchOptions(**{**given, "every": 7})
    name = rf"ampaudit\.integrations\.{framework}\.AmpAuditCallback\(\)"
    with pytest.raises(TypeError, match=rf"^{name} got an unexpected option 'evry'; its options are log, "):
        callback(evry=2)


def test_accelerates_watch_takes_every_watch_option():
    accelerate = _accelerate()
    from ampaudit.integrations.accelerate import watch

    accelerator = accelerate.Accelerator(cpu=True)
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="guard needs the GradScaler that skips steps, and this accelerator has none"):
        watch(accelerator, model, optimizer, guard=True)
    accelerator.scaler = torch.amp.GradScaler("cpu")  # what it holds with fp16 on a GPU
    given = samples()
    for mon in (watch(accelerator, model, optimizer, **given),
                watch(accelerator, model, optimizer, options=WatchOptions(**given))):
        assert mon.options == WatchOptions(**given)
        assert {name: EFFECTS[name](mon) for name in given} == {name: EXPECTED[name] for name in given}
    with pytest.raises(TypeError, match=r"^ampaudit\.integrations\.accelerate\.watch\(\) got an unexpected option"):
        watch(accelerator, model, optimizer, evry=2)
