"""Do `check --dtype fp8`'s verdicts predict training damage? (issue 29, "Done when")

For each model and seed: judge its Linears (tensorwise, on the first batch), then train k AdamW
steps (bf16 autocast, torchao's Float8Linear emulated on the CPU) with no layer in fp8 (the
bf16 reference) and with chosen layers in fp8 - the layers the check keeps in bf16, the same
number of the layers it passes (the best by its own table's SQNR: what a user would convert
first), every layer but the kept ones (the policy convert emits), every layer; on the planted
fixtures also the flagged layer under rowwise, rowwise_with_gw_hp (and mxfp8 on the outlier
channel), with the check's verdicts under those recipes printed per seed. Where the check also
keeps heads (AMP701) that rowwise_with_gw_hp keeps too, the kept layers that recipe passes are
trained alone as well: in fp8, against as many passed layers, and under each of those recipes.
Every fp8 model is converted by the file `convert --dtype fp8 --emit torchao` writes.
The *_sink models plant a massive token (--sink x) before an early block's second MLP Linear: the
first token in the language models, the first patch token in the ViTs.

Every model trains on a per-token (or per-image) cross-entropy, on a fresh batch every step
(the seed picks the initialisation and the data order; every configuration of a seed sees the
same batches): synthetic tasks whose labels depend on every token, as a language model's loss
does - Markov-chain text (4 successors per token) for the language models, noisy copies of 10
prototype images for the ViTs. Two measures per configuration and seed, against the bf16 run of the same seed:
  delta  the signed difference of the mean loss over the last quarter, relative to bf16's
         (positive: fp8 trained worse)
  last   the signed difference of the last step's loss alone
  gap    convert's training-check measure: sum |fp8 - bf16| over the last quarter over
         sum |bf16| (unsigned: a run that trains *better* has a gap too)
printed as mean +- sample standard deviation over the seeds. The null configuration - bf16
again, from weights each moved by a relative 2^-9 (about one bf16 rounding) - is how far two runs
of the same precision drift apart by chaos alone. A configuration "diverges" when its delta's
mean is positive, more than twice its spread over seeds, and more than twice the null's |delta|
(mean + 2 sd).

--per-layer trains each Linear alone in fp8 and prints, per layer, its delta beside the scores
the check could rank layers by, and each score's Spearman correlation with the damage.

    python bench/fp8_predict.py [--steps 50] [--seeds 0,1,2] [--models sink,channel,nanogpt,...]
        [--per-layer]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib.util
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ampaudit.convert.fp8 import Fp8Policy, emit_torchao, load_emitted  # noqa: E402
from ampaudit.graph.forward import ExampleInputs  # noqa: E402
from ampaudit.graph.fp8_casts import RECIPES, output_gemm  # noqa: E402
from ampaudit.graph.fp8_measure import fp8_forward, record, sqnr_db  # noqa: E402
from ampaudit.graph.fp8_verdicts import judge  # noqa: E402
from ampaudit.report.fp8_table import worst_operand_db  # noqa: E402

Batch = tuple[tuple, dict]


@dataclasses.dataclass
class Spec:
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Batch]  # a fresh batch; the model's output is its loss
    # the other recipes the flagged layers train under (the check's verdicts on them printed too)
    flagged_recipes: tuple[str, ...] = ()


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "fixtures" / "models" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _markov(vocab: int, batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    """Token sequences from a fixed random chain: each token has 4 possible successors."""
    successors = torch.randint(0, vocab, (vocab, 4), generator=torch.Generator().manual_seed(1234))
    ids = torch.empty(batch, seq + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for t in range(seq):
        ids[:, t + 1] = successors[ids[:, t], torch.randint(0, 4, (batch,), generator=g)]
    return ids


def _images(classes: int, batch: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy copies of fixed random prototype images, labelled by their prototype."""
    prototypes = torch.randn(classes, 3, 16, 16, generator=torch.Generator().manual_seed(1234))
    labels = torch.randint(0, classes, (batch,), generator=g)
    return prototypes[labels] + 2.0 * torch.randn(batch, 3, 16, 16, generator=g), labels


def sink() -> Spec:
    m = _load("fp8_sink_token_lm")
    return Spec(m.SinkTokenLM, lambda g: (m.make_batch(g), {}), ("rowwise",))


def channel() -> Spec:
    m = _load("fp8_outlier_channel_lm")
    # rowwise: not recommended (AMP703 holds under it too), trained to show it does not help;
    # mxfp8: recommended (its blocks of 32 confine the channel)
    return Spec(m.OutlierChannelLM, lambda g: (m.make_batch(g), {}), ("rowwise", "mxfp8"))


class _MseTo(nn.Module):
    """The earlier fixtures' loss: the mean squared error to a teacher's output (given)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x, target):
        return nn.functional.mse_loss(self.model(x), target)


def _mse_spec(fixture: str, cls: str, token: bool) -> Spec:
    m = _load(fixture)
    torch.manual_seed(1234)
    teacher = getattr(m, cls)().eval()
    shape = m.example_inputs()[0].shape

    def batch(g):
        x = torch.randn(shape, generator=g)
        if token:
            x[:, 0] *= 30000.0
        else:
            x[..., 5] *= 300000.0
        with torch.no_grad():
            return (x, teacher(x)), {}

    return Spec(lambda: _MseTo(getattr(m, cls)()), batch, ("rowwise",) if token else ())


def massive_mse() -> Spec:
    """fp8_massive_tokens.py with its earlier loss (MSE to a teacher), on fresh batches."""
    return _mse_spec("fp8_massive_tokens", "MassiveTokens", True)


def channels_mse() -> Spec:
    return _mse_spec("fp8_outlier_channels", "OutlierChannels", False)


def nanogpt() -> Spec:
    """clean_transformer.py's TinyLM in nanoGPT's char-level shape: vocab 65 (shakespeare_char)."""
    m = _load("clean_transformer")

    def batch(g):
        ids = _markov(65, 8, 32, g)
        return (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), {}

    return Spec(lambda: m.TinyLM(vocab_size=65, d_model=64, n_heads=4, max_seq_len=32, n_layers=2), batch)


SINK = 1e4  # --sink


def _sink_hook(module: nn.Module, args: tuple, output: torch.Tensor, token: int = 0) -> torch.Tensor:
    """Position `token`'s MLP activations SINK x: the massive activations trained LLMs grow at
    their first token, in an early layer's down_proj input (Sun et al., 2024: ~10^4x the median),
    and trained ViTs at a few patch tokens (Darcet et al., 2023: "Vision Transformers Need
    Registers"; Sun et al. find them in ViTs' middle layers too)."""
    output = output.clone()
    output[:, token] = output[:, token] * SINK
    return output


def nanogpt_sink() -> Spec:
    """nanogpt() with a massive first token planted in block 0's MLP (before its second Linear)."""
    spec = nanogpt()

    def build():
        model = spec.build()
        model.blocks[0].mlp[1].register_forward_hook(_sink_hook)
        return model

    return Spec(build, spec.batch, ("rowwise",))


def _llama(sink: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=128, vocab_size=65, max_position_embeddings=32)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    if sink:  # down_proj(act_fn(gate_proj(x)) * up_proj(x)): the sink enters layer 0's down_proj
        model.model.layers[0].mlp.act_fn.register_forward_hook(_sink_hook)
    return model


def llama_sink() -> Spec:
    """llama() with a massive first token planted in layer 0's down_proj input."""
    return Spec(lambda: _llama(sink=True), llama().batch, ("rowwise",))


def llama() -> Spec:
    build = _llama

    def batch(g):
        ids = _markov(65, 8, 32, g)[:, :-1]
        return (), {"input_ids": ids, "labels": ids}

    return Spec(build, batch)


class _WithLoss(nn.Module):
    """A classifier whose forward returns its cross-entropy (timm's models return logits)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x, labels):
        return nn.functional.cross_entropy(self.model(x), labels)


def vit() -> Spec:
    m = _load("timm_style")

    def build():
        model = m.get_model()
        # the same arithmetic out of place: the check's recording pass (since 0e4b20d) fails on
        # LayerScale's in-place mul_ of a Linear's output ("Output 0 of _InputGradLinear is a view
        # and is being modified inplace")
        for block in model.blocks:
            block.ls1.inplace = False
        return _WithLoss(model)

    return Spec(build, lambda g: (_images(10, 32, g), {}))


def vit_sink() -> Spec:
    """vit() with a massive first patch token planted in block 0's MLP (fc2's input)."""
    spec = vit()

    def build():
        model = spec.build()
        model.model.blocks[0].mlp.act.register_forward_hook(_sink_hook)
        return model

    return Spec(build, spec.batch, ("rowwise",))


def _hf_vit(sink: bool = False) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=128, num_labels=10)
    config._attn_implementation = "eager"
    model = ViTForImageClassification(config)
    if sink:  # fc2(activation_fn(fc1(x))): the sink enters layer 0's fc2 at the first patch token
        # (position 1; 0 is CLS, which the classifier reads)
        model.vit.layers[0].mlp.activation_fn.register_forward_hook(functools.partial(_sink_hook, token=1))
    return model


def hf_vit_sink() -> Spec:
    """hf_vit() with a massive first patch token planted in layer 0's output.dense input."""
    return Spec(lambda: _hf_vit(sink=True), hf_vit().batch, ("rowwise",))


def hf_vit() -> Spec:
    build = _hf_vit

    def batch(g):
        x, y = _images(10, 32, g)
        return (), {"pixel_values": x, "labels": y}

    return Spec(build, batch)


MODELS = {"sink": sink, "channel": channel, "massive_mse": massive_mse, "channels_mse": channels_mse,
          "nanogpt": nanogpt, "llama": llama,
          "nanogpt_sink": nanogpt_sink, "llama_sink": llama_sink, "vit": vit, "hf_vit": hf_vit,
          "vit_sink": vit_sink, "hf_vit_sink": hf_vit_sink}


def _loss(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


@functools.cache
def _emitted(recipe: str, fp8: frozenset[str], linears: tuple[str, ...]) -> Any:
    """What `convert --dtype fp8 --emit torchao` writes for ``recipe`` with exactly ``fp8`` in
    fp8, loaded: the bench converts as a user's emitted file does (MXFP8 too, and the input
    casts emulated training under CPU autocast needs)."""
    policy = Fp8Policy(recipe, {name: "bench" for name in linears if name not in fp8}, sorted(fp8))
    path = Path(tempfile.mkdtemp()) / "fp8_torchao.py"
    path.write_text(emit_torchao(policy))
    return load_emitted(path)


def train(model: nn.Module, batches: list[Batch], names: set[str], recipe: str, jitter: float = 0.0,
          lr: float = 3e-3, autocast: bool = True) -> list[float]:
    model = copy.deepcopy(model).train()
    if jitter:  # the null configuration: bf16 from weights moved by about one bf16 rounding
        g = torch.Generator().manual_seed(99)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + jitter * torch.randn(p.shape, generator=g))
    for m in model.modules():  # no dropout: the runs of a seed differ only by their precision
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "drop_prob", None), float):  # timm's DropPath (stochastic depth)
            m.drop_prob = 0.0
    if names:
        linears = tuple(name for name, m in model.named_modules() if isinstance(m, nn.Linear))
        _emitted(recipe, frozenset(names), linears).convert(model, emulate=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for args, kwargs in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(model(*args, **kwargs)).float()
        losses.append(float(loss.detach()))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return losses


def _tail(values: list[float]) -> list[float]:
    return values[-max(1, len(values) // 4):]


def delta(reference: list[float], values: list[float]) -> float:
    """Signed: the last quarter's mean loss over bf16's, less 1."""
    if not all(math.isfinite(x) for x in values):
        return math.inf
    return statistics.fmean(_tail(values)) / statistics.fmean(_tail(reference)) - 1


def final(reference: list[float], values: list[float]) -> float:
    """Signed, the last step's loss only."""
    return values[-1] / reference[-1] - 1 if math.isfinite(values[-1]) else math.inf


def gap(reference: list[float], values: list[float]) -> float:
    """convert's training-check measure (unsigned)."""
    r, v = _tail(reference), _tail(values)
    if not all(math.isfinite(x) for x in v):
        return math.inf
    return sum(abs(a - b) for a, b in zip(r, v, strict=True)) / max(sum(abs(a) for a in r), 1e-12)


def measures(reference: list[float], values: list[float]) -> tuple[float, float, float]:
    return delta(reference, values), gap(reference, values), final(reference, values)


def _ms(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:+.2%}"
    return f"{statistics.fmean(values):+.2%} +- {statistics.stdev(values):.2%}"


def _diverges(values: list[float], null: list[float]) -> str:
    if len(values) < 2:
        return ""
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    floor = abs(statistics.fmean(null)) + 2 * statistics.stdev(null)
    return "  DIVERGES" if mean > 2 * sd and mean > 2 * floor else ""


def scores(model: nn.Module, inputs: ExampleInputs, judgement, recipe: str) -> dict[str, dict[str, float]]:
    """Per layer, what the check could rank by (higher = worse in fp8): its table's worst
    operand SQNR and the three GEMMs' (negated), the model output's SQNR loss with only this
    layer in fp8 (AMP705's forward, once per layer), and the first-order loss change
    |sum(grad_output * output error)| from the recording pass's own tensors."""
    rec, _, _ = record(model, inputs)
    reference = judgement.measurement.reference
    found = {}
    for v in judgement.layers:
        layer = v.layer
        row = layer.to_dict()
        gemms = layer.gemms
        r = rec[layer.name]
        out, _ = output_gemm(r.x, r.module.weight.detach().float(), RECIPES[recipe])
        found[layer.name] = {
            "input": -float(worst_operand_db(row["operands"][recipe])),
            "out": -gemms.get("output", math.inf), "gi": -gemms.get("grad_input", math.inf),
            "gw": -gemms.get("grad_weight", math.inf),
            "alone": -sqnr_db(reference, fp8_forward(model, inputs, {layer.name}, RECIPES[recipe],
                                                     kept=judgement.measurement.outputs_kept)),
            "taylor": abs(float((r.grad * (out - r.out)).sum())) if r.grad is not None else 0.0,
        }
    return found


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    den = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return num / den if den else float("nan")


def run_model(name: str, opts: argparse.Namespace) -> None:
    spec = MODELS[name]()
    seeds = [int(s) for s in opts.seeds.split(",")]
    results: dict[str, list[tuple[float, float, float]]] = {}
    per_layer: dict[str, list[float]] = {}
    layer_scores: dict[str, dict[str, float]] = {}
    finals, kept_sets = [], []
    by_recipe: dict[str, list[dict[str, list[str]]]] = {}  # the other recipes' verdicts, per seed
    start = time.perf_counter()
    for seed in seeds:
        torch.manual_seed(seed)
        model = spec.build()
        g = torch.Generator().manual_seed(seed)
        batches = [spec.batch(g) for _ in range(1 if opts.fixed_batch else opts.steps)]
        batches = batches * (opts.steps if opts.fixed_batch else 1)
        inputs = ExampleInputs(*batches[0], "bench")
        judgement = judge(model, inputs, opts.recipe)
        keep = [v.layer.name for v in judgement.layers if v.keep]
        passed = [v.layer.name for v in judgement.layers if not v.keep]
        kept_sets.append({v.layer.name: [x.code for x in v.verdicts] for v in judgement.layers if v.keep})
        table = {v.layer.name: float(worst_operand_db(v.layer.to_dict()["operands"][opts.recipe]))
                 for v in judgement.layers}
        n = min(len(keep), len(passed))
        configs: dict[str, tuple[set[str], str]] = {}
        gw_hp = ("rowwise_with_gw_hp",) if spec.flagged_recipes else ()
        if keep:
            configs["'keep' layers in fp8"] = (set(keep[:n]), opts.recipe)
            configs["as many 'fp8' layers (best SQNR)"] = (set(sorted(passed, key=lambda x: -table[x])[:n]),
                                                          opts.recipe)
            configs["policy (all but 'keep')"] = (set(passed), opts.recipe)
            for other in spec.flagged_recipes + gw_hp:
                configs[f"'keep' layers, {other}"] = (set(keep[:n]), other)
        others = {other: judge(model, inputs, other).keep for other in spec.flagged_recipes + gw_hp}
        for other, kept in others.items():  # what the check says of the same layers under them
            by_recipe.setdefault(other, []).append(
                {v.layer.name: [x.code + (f" ({x.case})" if x.case else "") for x in v.verdicts] for v in kept})
        if spec.flagged_recipes:
            # the kept layers the recommended recipe passes (the outlier verdicts' alone, without
            # the heads AMP701 keeps under every recipe, whose own damage would mix in): since AMP702
            # judges the grad-weight GEMM, rowwise_with_gw_hp
            rescuer = (gw_hp or spec.flagged_recipes)[0]
            kept_there = {v.layer.name for v in others[rescuer]}
            rescued = [x for x in keep if x not in kept_there]
            if rescued and len(rescued) < len(keep):
                m = len(rescued)
                configs[f"{rescuer}-rescued 'keep' in fp8"] = (set(rescued), opts.recipe)
                configs[f"as many 'fp8' layers ({m})"] = (set(sorted(passed, key=lambda x: -table[x])[:m]),
                                                         opts.recipe)
                for other in spec.flagged_recipes + gw_hp:
                    configs[f"rescued 'keep', {other}"] = (set(rescued), other)
        configs["every layer"] = (set(keep + passed), opts.recipe)
        run = functools.partial(train, lr=opts.lr, autocast=not opts.fp32)
        reference = run(model, batches, set(), opts.recipe)
        finals.append(statistics.fmean(_tail(reference)))
        null = run(model, batches, set(), opts.recipe, jitter=2.0 ** -9)
        results.setdefault("null: reference, weights jittered 2^-9", []).append(measures(reference, null))
        for label, (names, recipe) in configs.items():
            losses = run(model, batches, names, recipe)
            results.setdefault(label, []).append(measures(reference, losses))
        if opts.per_layer:
            found = scores(model, inputs, judgement, opts.recipe)
            for layer in table:
                per_layer.setdefault(layer, []).append(delta(reference, run(model, batches, {layer}, opts.recipe)))
                for k, value in found[layer].items():
                    layer_scores.setdefault(layer, {}).setdefault(k, 0.0)
                    layer_scores[layer][k] += value / len(seeds)
    setup = f"lr {opts.lr:g}" + (", one fixed batch" if opts.fixed_batch else ", fresh batches") + (
        ", fp32 reference" if opts.fp32 else "")
    seconds = time.perf_counter() - start
    print(f"{name}: {len(table)} Linear, seeds {seeds}, {opts.steps} steps ({setup}), {seconds:.0f} s")
    print(f"  kept by the check ({opts.recipe}), per seed: {kept_sets}")
    for other, kept in by_recipe.items():
        print(f"  kept by the check ({other}), per seed: {kept}")
    sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
    print(f"  {'fp32' if opts.fp32 else 'bf16'} reference: last-quarter loss {statistics.fmean(finals):.4f} "
          f"+- {sd:.4f} over seeds")
    null = [d for d, _, _ in results["null: reference, weights jittered 2^-9"]]
    for label, triples in results.items():
        deltas, gaps, finals_ = ([t[i] for t in triples] for i in range(3))
        print(f"  {label:<34} delta {_ms(deltas):<18} gap {_ms(gaps):<18} last step {_ms(finals_):<18}"
              f"{_diverges(deltas, null)}")
    if per_layer:
        layers = list(per_layer)
        damage = [statistics.fmean(per_layer[x]) for x in layers]
        keys = list(next(iter(layer_scores.values())))
        print("  per layer alone in fp8: delta (mean +- sd) | scores (higher = worse): " + " ".join(keys))
        for layer in layers:
            values = " ".join(f"{layer_scores[layer][k]:.3g}" for k in keys)
            print(f"    {layer:<40} {_ms(per_layer[layer]):<18} | {values}")
        print("  Spearman(score, damage): " + ", ".join(
            f"{k} {spearman([layer_scores[x][k] for x in layers], damage):+.2f}" for k in keys))
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--per-layer", action="store_true")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--fp32", action="store_true",
                        help="no bf16 autocast: the reference is fp32")
    parser.add_argument("--fixed-batch", action="store_true", help="one batch every step (the earlier bench's setup)")
    parser.add_argument("--sink", type=float, default=SINK, help="the planted first token's factor (*_sink)")
    opts = parser.parse_args()
    globals()["SINK"] = opts.sink
    torch.set_num_threads(1)
    for name in opts.models.split(","):
        run_model(name, opts)


if __name__ == "__main__":
    main()
