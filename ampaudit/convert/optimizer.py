"""Loss scaling, and fp32 master weights where needed, around any torch.optim optimizer.

A model converted with ``weights="fp32"`` (the default for training) keeps fp32 parameters:
the optimizer steps them directly and this adds loss scaling and the inf/NaN skip. With
``weights="low"`` the model holds low-precision working copies and the optimizer is
re-pointed at fp32 masters of them (apex O2's recipe), keeping its hyperparameters and
state. Backward moves each low gradient into its master's fp32 gradient as soon as it is
accumulated (a post-accumulate-grad hook), so the two are never both alive. A step unscales
the gradients, checks for inf/NaN with one host sync, skips the step (weights and optimizer
state untouched) when it finds any, and otherwise updates the fp32 weights (and copies the
masters back into the model).

The working copies are stale while the masters are updated, and that update is where a
training step's memory peaks (AdamW's temporaries): by default (``release_low=True``) their
storage is freed for the optimizer's own step and allocated again for the copy back, so the
peak holds what autocast + GradScaler's does. The tensors stay the same objects (ties and
views survive) but not the same addresses: ``release_low=False`` keeps them, for code that
needs static weight addresses (CUDA graphs), at 2 bytes per parameter more at the peak."""

from __future__ import annotations

from typing import Any

import torch

from ampaudit.core.errors import UsageError


class LossScaler:
    """Dynamic (or static) loss scale: backoff on overflow, growth after clean steps."""

    def __init__(self, init_scale: float = 2.0**16, *, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, max_scale: float = 2.0**24, dynamic: bool = True) -> None:
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.max_scale, self.dynamic = growth_interval, max_scale, dynamic
        self.clean_steps = 0

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "max_scale": self.max_scale, "dynamic": self.dynamic}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def make_scaler(loss_scale: str | float | LossScaler | None, dtype: torch.dtype) -> LossScaler | None:
    """"auto": dynamic for fp16, none for bf16 (fp32's range); "dynamic"; a number: static."""
    if isinstance(loss_scale, LossScaler) or loss_scale is None:
        return loss_scale
    if loss_scale == "auto":
        return LossScaler() if dtype == torch.float16 else None
    if loss_scale == "dynamic":
        return LossScaler()
    if isinstance(loss_scale, (int, float)):
        return LossScaler(float(loss_scale), dynamic=False)
    raise UsageError(f"loss_scale must be 'auto', 'dynamic', a number or None (got {loss_scale!r})")


class MixedPrecisionOptimizer:
    """Wraps the user's optimizer: ``backward(loss)``, ``unscale_()``, ``step()``, ``zero_grad()``."""

    def __init__(self, optimizer: torch.optim.Optimizer, pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]],
                 fp32_params: list[torch.nn.Parameter], scaler: LossScaler | None, *, release_low: bool = True) -> None:
        self.optimizer = optimizer
        self.pairs = pairs  # (low-precision model parameter, its fp32 master)
        self.fp32_params = fp32_params  # model parameters already in fp32: the optimizer updates them directly
        self.scaler = scaler
        self.release_low = release_low  # free the working copies' storage during the optimizer's step
        self.skipped_steps = 0
        self._unscaled: bool | None = None  # found_inf of the current step, once unscaled
        # Each low-precision gradient moves into its master's fp32 gradient as soon as autograd
        # has accumulated it, and is freed: low and fp32 gradients are never both alive.
        self._hooks = [working.register_post_accumulate_grad_hook(self._to_master(master))
                       for working, master in pairs if working.requires_grad]

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, original: torch.nn.Module, converted: torch.nn.Module,
                       *, dtype: torch.dtype, loss_scale: str | float | LossScaler | None = "auto",
                       release_low: bool = True) -> MixedPrecisionOptimizer:
        """Re-point ``optimizer`` (built on ``original``'s parameters) at fp32 masters of
        ``converted``'s parameters, moving its per-parameter state along."""
        converted_params = dict(converted.named_parameters(remove_duplicate=False))
        names: dict[int, list[str]] = {}  # a tied tensor has several names: any may be the converted one's
        for name, param in original.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        replacement: dict[int, torch.nn.Parameter] = {}
        pairs, fp32 = [], []
        for param in original.parameters():
            working = next((converted_params[n] for n in names[id(param)] if n in converted_params), None)
            if working is None:  # not used by the converted graph: train the original, harmlessly
                replacement[id(param)] = param
            elif working.dtype != torch.float32 and working.is_floating_point():
                master = torch.nn.Parameter(working.detach().float().clone())
                master.data.copy_(param.detach())  # the exact fp32 values, not the rounded copy
                pairs.append((working, master))
                replacement[id(param)] = master
            else:
                fp32.append(working)
                replacement[id(param)] = working
        foreign = sum(id(p) not in replacement for g in optimizer.param_groups for p in g["params"])
        if foreign:
            raise UsageError(f"{foreign} of the optimizer's parameters are not the model's: build the optimizer "
                             "on the parameters of the model you convert")
        for group in optimizer.param_groups:
            group["params"] = [replacement[id(p)] for p in group["params"]]
        moved = {}
        for param, state in list(optimizer.state.items()):
            new = replacement.get(id(param), param)
            if new.dtype != param.dtype:  # a bf16 model's state (Adam's moments) for its fp32 weights
                state = {k: v.to(new.dtype) if isinstance(v, torch.Tensor) and v.shape == param.shape else v
                         for k, v in state.items()}
            moved[new] = state
        optimizer.state.clear()
        optimizer.state.update(moved)
        return cls(optimizer, pairs, fp32, make_scaler(loss_scale, dtype), release_low=release_low)

    # -- the training-loop API ------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` with the loss multiplied by the current scale."""
        (loss.float() * self.scale if self.scaler is not None else loss).backward(**kwargs)

    @staticmethod
    def _to_master(master: torch.nn.Parameter):
        def move(working: torch.Tensor) -> None:
            grad = working.grad.detach().float()
            master.grad = grad if master.grad is None else master.grad.add_(grad)  # accumulation across backwards
            working.grad = None
        return move

    def zero_grad(self, set_to_none: bool = True) -> None:
        for working, master in self.pairs:
            working.grad = None
            master.grad = None
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._unscaled = None

    def unscale_(self) -> bool:
        """Divide the masters' gradients by the scale (before clipping).
        Returns whether any gradient is inf or NaN. Safe to call once per step or not at all."""
        if self._unscaled is not None:
            return self._unscaled
        grads = [master.grad for _, master in self.pairs if master.grad is not None]  # moved there in backward
        grads += [p.grad for p in self.fp32_params if p.grad is not None]
        if not grads:
            self._unscaled = False
            return False
        # GradScaler's fused unscale-and-check, per device and dtype: one pass over each
        # gradient and no temporaries (torch.isfinite allocates twice a gradient's size)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        sparse = []
        for g in grads:
            (sparse if g.is_sparse else groups.setdefault((g.device, g.dtype), [])).append(g)
        found = []
        for (device, _), group in groups.items():
            found.append(torch.zeros(1, device=device))
            inv_scale = torch.full((1,), 1.0 / self.scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found[-1], inv_scale)
        for g in sparse:
            g.mul_(1.0 / self.scale)
            found.append((~torch.isfinite(g.coalesce().values())).any().float().reshape(1))
        bad = torch.cat([f.to(found[0].device) for f in found]).sum()
        self._unscaled = bool(bad.item() > 0)  # the one host sync per step
        return self._unscaled

    def step(self) -> bool:
        """Update the masters and copy them into the model; skip the step on inf/NaN.
        Returns whether the step was taken."""
        found_inf = self.unscale_()
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if found_inf:
            self.skipped_steps += 1
            self.zero_grad()
            return False
        released = self._release() if self.release_low else []
        try:
            self.optimizer.step()
        finally:
            with torch.no_grad():
                for storage, nbytes in released:
                    storage.resize_(nbytes)
                for working, master in self.pairs:
                    working.copy_(master)
        self._unscaled = None
        return True

    def _release(self) -> list[tuple[torch.UntypedStorage, int]]:
        """Free the working copies' storage (each storage once: tied or viewed weights share
        one), for :meth:`step` to allocate again; storages that cannot be resized stay."""
        released, seen = [], set()
        for working, _ in self.pairs:
            storage = working.untyped_storage()
            if storage.data_ptr() in seen or not storage.resizable() or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            released.append((storage, storage.nbytes()))
        for storage, _ in released:
            storage.resize_(0)
        return released

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "masters": [m.detach().clone() for _, m in self.pairs],
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["masters"]) != len(self.pairs):
            raise UsageError(f"checkpoint has {len(state['masters'])} master weights, this optimizer "
                             f"{len(self.pairs)}: it belongs to another model")
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for (working, master), saved in zip(self.pairs, state["masters"], strict=True):
                master.copy_(saved)
                working.copy_(saved)
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)
