"""Benchmark: the peak bytes of one training step of a converted model against torch.autocast +
GradScaler's (issue 26 item 6: at most 1.02x on HF GPT-2 and on a lucidrains-style DDPM U-Net).

Models: transformers' GPT-2 from a tiny, MLP-heavy config (tanh GELU: NewGELUActivation's
``pow(x, 3)``) and ``fixtures/models/ddpm_unet.py`` (lucidrains' denoising-diffusion U-Net shape:
F.normalize RMSNorm, LinearAttention, Attend). Variants: ``autocast`` (fp16 autocast + GradScaler),
``convert`` (ampaudit.convert(model, optimizer) with its defaults: backend auto, weights fp32)
and ``convert --backend fx/modules`` where they differ. The peak is peak_rise's (bench/convert_speed.py):
every allocation the allocator reports during a whole step (forward, backward, optimizer step).

On a CPU the reference is CPU autocast, whose fp16 lists are shorter than CUDA's: it runs
softmax, layer_norm and the norms in fp16 where the plan - and CUDA autocast - compute them in
fp32, so the converted step can hold more than CPU autocast for what CUDA autocast holds too.

A third reference, ``autocast-cuda``, runs CPU autocast with the ops CUDA autocast upcasts
(the catalog's autocast = "fp32" column: softmax, log_softmax, layer_norm, norms, exp, pow,
...) given fp32 inputs, as CUDA's lists would: what the 1.02x target means on a GPU.

Run: python bench/convert_peak.py [--models gpt2,ddpm]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def gpt2():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=128, n_positions=256,
                        activation_function="gelu_new", attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    ids = torch.randint(0, 128, (4, 256), generator=torch.Generator().manual_seed(0))
    return GPT2LMHeadModel(config), {"input_ids": ids}, lambda out: out.logits.float().pow(2).mean()


def ddpm():
    sys.path.insert(0, str(ROOT))
    from fixtures.models import ddpm_unet

    return ddpm_unet.get_model(), ddpm_unet.example_inputs(batch=4, size=32), lambda out: out.float().pow(2).mean()


MODELS = {"gpt2": gpt2, "ddpm": ddpm}


def cuda_lists():
    """A TorchFunctionMode giving fp32 inputs to each op CUDA autocast upcasts (catalog)."""
    import torch
    from torch.overrides import TorchFunctionMode

    from ampaudit.core.catalog import builtin_catalog

    catalog = builtin_catalog()

    def up(value):
        if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
            return value.float()
        if isinstance(value, (list, tuple)):
            return type(value)(up(v) for v in value)
        return value

    class Upcast(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "") or ""
            policy = catalog.lookup(catalog.canonical_kind(name)) if name and not name.endswith("_") else None
            if policy is not None and policy.autocast == "fp32":
                args, kwargs = up(args), {k: up(v) for k, v in kwargs.items()}
            return func(*args, **kwargs)

    return Upcast()


def step_peak(name: str, variant: str, backend: str = "auto") -> int:
    import contextlib

    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from convert_speed import peak_rise, train_step

    import ampaudit

    model, inputs, loss_of = MODELS[name]()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if variant == "convert":
        model, optimizer = ampaudit.convert(model, optimizer, example_inputs=inputs, verify=False, train_steps=0,
                                            backend=backend)
    scaler = torch.amp.GradScaler("cpu")

    def call():
        return model(**inputs) if isinstance(inputs, dict) else model(*inputs)

    cuda_like = variant == "autocast-cuda"
    if cuda_like:
        variant = "autocast"

    def step():
        with cuda_lists() if cuda_like else contextlib.nullcontext():
            train_step(variant, lambda: loss_of(call()), optimizer, scaler, "cpu")

    step()
    return peak_rise(step)["all"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,ddpm")
    args = parser.parse_args()
    for name in args.models.split(","):
        autocast = step_peak(name, "autocast")
        cuda = step_peak(name, "autocast-cuda")
        print(f"{name}: autocast + GradScaler {autocast / 1024:,.0f} KiB; with CUDA's fp32 list "
              f"{cuda / 1024:,.0f} KiB", flush=True)
        for backend in ("fx", "modules"):
            peak = step_peak(name, "convert", backend)
            print(f"{name}: convert --backend {backend} {peak / 1024:,.0f} KiB = {peak / autocast:.3f}x CPU "
                  f"autocast's, {peak / cuda:.3f}x with CUDA's list", flush=True)


if __name__ == "__main__":
    main()
