"""The old ``torch.nn.utils.spectral_norm`` on a freshly built model, made to behave as trained.

It starts ``u`` and ``v`` random and improves them one power iteration per *training* forward;
an eval forward divides the weight by ``u @ W @ v`` as it stands. A model built from a file and
never trained (a GAN's discriminator, HiFi-GAN's first scale) so divides by a random estimate
of the norm, often 1e-3 of it: outputs in the 1e11s, overflow findings and a training check that
can only fail, none of which the model shows once it trains. ``torch.nn.utils.parametrizations.
spectral_norm`` iterates 15 times when applied; this does the same for the old one, on the
model ampaudit loaded - where ``u`` and ``v`` were already converged (a checkpoint) they are left
exactly as they were.
"""

from __future__ import annotations

import torch
from torch.nn.utils.spectral_norm import SpectralNorm

ITERATIONS = 15  # what torch.nn.utils.parametrizations.spectral_norm runs when applied
CONVERGED = 0.05  # an estimate within 5% of the iterated norm was already iterated


def converge_spectral_norms(model: torch.nn.Module) -> list[str]:
    """Iterate each unconverged old-style spectral norm of ``model`` in place; the names of the
    modules changed."""
    changed = []
    for name, module in model.named_modules():
        for hook in list(module._forward_pre_hooks.values()):
            if isinstance(hook, SpectralNorm) and _converge(module, hook):
                changed.append(name or "(model)")
    return changed


def _converge(module: torch.nn.Module, norm: SpectralNorm) -> bool:
    u, v = getattr(module, norm.name + "_u"), getattr(module, norm.name + "_v")
    saved = u.clone(), v.clone()
    with torch.no_grad():
        weight = norm.reshape_weight_to_matrix(getattr(module, norm.name + "_orig"))
        before = float(torch.dot(u, torch.mv(weight, v)))
        for _ in range(ITERATIONS):
            norm.compute_weight(module, do_power_iteration=True)  # updates u and v in place
        after = float(torch.dot(u, torch.mv(weight, v)))
        if abs(after - before) <= CONVERGED * abs(after):
            u.copy_(saved[0])
            v.copy_(saved[1])
            return False
        setattr(module, norm.name, norm.compute_weight(module, do_power_iteration=False).detach())
    return True
