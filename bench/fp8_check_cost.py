"""What `check --dtype fp8` costs against one fp32 forward and backward (issue 29: at most 3x).

Two GPT-shaped transformers (pre-norm blocks: qkv, attention projection, a 4x MLP; a linear
head), each timed as a plain fp32 forward + backward (mean-square loss, as the audit uses) and
as the fp8 audit (`graph/fp8_verdicts.judge`: the recording forward and backward, every
Linear's operands cast under every recipe, the chosen recipe's GEMMs, the dominance
forwards), interleaved, median of the rounds. The audit's parts are its own timings. Each is
timed by the wall clock and by the process's CPU time: on a VM shared with other jobs the wall
clock counts the time the process waited for a core; its CPU time does not.

    python bench/fp8_check_cost.py [--rounds 5] [--shapes 256x512,1024x256] [--recipe tensorwise] [--threads 1]

A shape is DxT: width D, T tokens (one sequence). `--massive` plants massive-activation
tokens (x3000 on the first token) in the first block's input, as in a trained LLM (its LayerNorms
leave no Linear an outlier token); `--sink` plants one (x30000 on the first token) in every
block's MLP activations, the input of its second MLP Linear (as trained LLMs' down_proj sees
them): the layers AMP702 measures the grad-weight GEMM of.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ampaudit.graph.forward import ExampleInputs  # noqa: E402
from ampaudit.graph.fp8_measure import model_loss  # noqa: E402
from ampaudit.graph.fp8_verdicts import judge  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, d: int, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, max(1, d // 64)) for _ in range(blocks))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _sink(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    output = output.clone()
    output[:, 0] = output[:, 0] * 30000.0  # the first token's MLP activations, massive
    return output


def _fwd_bwd(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    model_loss(model(x)).backward()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    model.zero_grad(set_to_none=True)
    return seconds, cpu


def _audit(model: nn.Module, x: torch.Tensor, recipe: str) -> tuple[float, float, dict, list]:
    start, cpu = time.perf_counter(), time.process_time()
    judgement = judge(model, ExampleInputs((x,), {}, "bench"), recipe)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    verdicts = [(v.layer.name, [x.code for x in v.verdicts]) for v in judgement.layers]
    return seconds, cpu, dict(judgement.measurement.seconds), verdicts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", default="256x512,1024x256")
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--massive", action="store_true")
    parser.add_argument("--sink", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)  # on a shared VM, 1 thread is steadier than 2 contended ones
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, recipe {opts.recipe}, "
          f"median of {opts.rounds} rounds{', a sink in every MLP' if opts.sink else ''}")
    for shape in opts.shapes.split(","):
        d, t = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        model = Transformer(d).eval()
        if opts.sink:
            for block in model.blocks:
                block.fc.register_forward_hook(_sink)
        x = torch.randn(1, t, d, generator=torch.Generator().manual_seed(0))
        if opts.massive:
            x[:, 0] *= 3000.0
        _fwd_bwd(model, x)  # warm-up: the first call allocates
        _audit(model, x, opts.recipe)
        base, audit, base_cpu, audit_cpu, parts = [], [], [], [], []
        verdicts: list = []
        for _ in range(opts.rounds):
            seconds, cpu = _fwd_bwd(model, x)
            base.append(seconds)
            base_cpu.append(cpu)
            seconds, cpu, part, verdicts = _audit(model, x, opts.recipe)
            audit.append(seconds)
            audit_cpu.append(cpu)
            parts.append(part)
        b, a = statistics.median(base), statistics.median(audit)
        bc, ac = statistics.median(base_cpu), statistics.median(audit_cpu)
        keys = sorted({k for p in parts for k in p})
        split = ", ".join(f"{k} {statistics.median(p.get(k, 0.0) for p in parts) * 1e3:.0f} ms" for k in keys)
        kept = sum(1 for _, codes in verdicts if codes)
        print(f"d={d} T={t}: fp32 forward+backward {b * 1e3:.1f} ms, fp8 audit {a * 1e3:.1f} ms: "
              f"{a / b:.2f}x ({split}); CPU time {bc * 1e3:.1f} ms, {ac * 1e3:.1f} ms: {ac / bc:.2f}x; "
              f"{len(verdicts)} Linear, {kept} kept in bf16")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
