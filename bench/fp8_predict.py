"""Do `check --dtype fp8`'s verdicts predict training damage? (issue 29, "Done when")

For each model: judge its Linears (tensorwise), then train 50 AdamW steps (bf16 autocast, torchao
Float8Linear emulated on the CPU) three ways - no layer in fp8 (the bf16 reference), only the
layers the check keeps in bf16 converted to fp8, and as many of the layers it passes - and
print each curve's gap to the reference over its last quarter (relative to the reference's
area, as convert's training check). Where the check keeps no layer, the comparison is by the
measured SQNR instead: the n worst layers against the n best.

The loss is the model's own where it computes one, else the mean squared error to a teacher
(the same architecture, another seed), so that precision matters to what is learned.

    python bench/fp8_predict.py [--steps 50] [--models nanogpt,llama,vit,massive]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ampaudit.graph.forward import ExampleInputs  # noqa: E402
from ampaudit.graph.fp8_verdicts import judge  # noqa: E402
from ampaudit.report.fp8_table import worst_operand_db  # noqa: E402


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "fixtures" / "models" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nanogpt():
    m = _load("clean_transformer")
    torch.manual_seed(0)
    idx, targets = m.example_inputs()
    return m.build_model, (idx, targets), {}


def llama():
    m = _load("hf_llama")
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (4, 16))
    return m.get_model, (), {"input_ids": ids, "labels": ids}


def vit():
    m = _load("timm_style")
    torch.manual_seed(0)
    return m.get_model, (torch.randn(8, 3, 16, 16),), {}


def massive():
    m = _load("fp8_massive_tokens")
    return m.MassiveTokens, m.example_inputs(), {}


def channels():
    m = _load("fp8_outlier_channels")
    return m.OutlierChannels, m.example_inputs(), {}


MODELS = {"nanogpt": nanogpt, "llama": llama, "vit": vit, "massive": massive, "channels": channels}


def _first(value):
    if isinstance(value, torch.Tensor):
        return value
    loss = getattr(value, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    logits = getattr(value, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    return next(v for v in (value if isinstance(value, (tuple, list)) else value.values())
                if isinstance(v, torch.Tensor))


def train(model, args, kwargs, target, names, recipe, steps):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = copy.deepcopy(model).eval()
    if names:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in names)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    torch.manual_seed(0)
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = _first(model(*args, **kwargs)).float()
            loss = out if target is None else torch.nn.functional.mse_loss(out, target)
        losses.append(float(loss.detach()))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return losses


def gap(reference, values):
    window = max(1, len(reference) // 4)
    r, v = reference[-window:], values[-window:]
    if not all(math.isfinite(x) for x in v):
        return math.inf
    return sum(abs(a - b) for a, b in zip(r, v, strict=True)) / max(sum(abs(a) for a in r), 1e-12)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--recipe", default="tensorwise")
    opts = parser.parse_args()
    for name in opts.models.split(","):
        build, args, kwargs = MODELS[name]()
        torch.manual_seed(0)
        model = build()
        inputs = ExampleInputs(tuple(args), dict(kwargs), "bench")
        judgement = judge(model, inputs, opts.recipe)
        keep = [v.layer.name for v in judgement.layers if v.keep]
        passed = [v.layer.name for v in judgement.layers if not v.keep]
        with torch.no_grad():
            out = model(*args, **kwargs)
        target = None
        if _first(out).numel() != 1 and getattr(out, "loss", None) is None:
            torch.manual_seed(1)
            with torch.no_grad():
                target = _first(build()(*args, **kwargs)).float()
        if keep:
            n = min(len(keep), len(passed))
            # the passed layers with the best SQNR: what a user would convert first
            score = {v.layer.name: worst_operand_db(v.layer.to_dict()["operands"][opts.recipe])
                     for v in judgement.layers}
            chosen_keep, chosen_fp8 = keep[:n], sorted(passed, key=lambda x: -float(score[x]))[:n]
            mode = "verdicts"
        else:
            score = {v.layer.name: float(worst_operand_db(v.layer.to_dict()["operands"][opts.recipe]))
                     for v in judgement.layers}
            ranked = sorted(score, key=score.get)
            n = max(1, len(ranked) // 3)
            chosen_keep, chosen_fp8 = ranked[:n], ranked[-n:]
            mode = "SQNR-ranked (no layer kept)"
        reference = train(model, args, kwargs, target, set(), opts.recipe, opts.steps)
        worse = train(model, args, kwargs, target, set(chosen_keep), opts.recipe, opts.steps)
        better = train(model, args, kwargs, target, set(chosen_fp8), opts.recipe, opts.steps)
        every = train(model, args, kwargs, target, set(keep + passed), opts.recipe, opts.steps)
        print(f"{name}: {len(judgement.layers)} Linear, kept {keep} ({mode}); n={len(chosen_keep)}")
        print(f"  bf16 loss {reference[0]:.4g} -> {reference[-1]:.4g}")
        print(f"  'keep' layers in fp8 {chosen_keep}: loss {worse[-1]:.4g}, gap {gap(reference, worse):.3%}")
        print(f"  'fp8' layers in fp8 {chosen_fp8}: loss {better[-1]:.4g}, gap {gap(reference, better):.3%}")
        print(f"  every layer in fp8: loss {every[-1]:.4g}, gap {gap(reference, every):.3%}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
