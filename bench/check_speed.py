"""Benchmark: `ampaudit check` on GPT-2 small (124M, built in code).

1. Without example inputs: load / trace / classify / report, against a bare
   torch.fx.symbolic_trace of the same model in the same process. Target: <= 2x.
2. With example inputs (the range audit: one fp32 run plus every op re-run in float16 on its
   fp32 inputs cast down): against one plain fp32 forward of the model. Target: <= 3x.

Run: python bench/check_speed.py [--repeat N] [--tokens T]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.fx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ampaudit.check.audit import analyse, audit_model  # noqa: E402
from ampaudit.core.catalog import build_catalog  # noqa: E402
from ampaudit.core.config import Config  # noqa: E402
from ampaudit.core.console import make_console  # noqa: E402
from ampaudit.core.dtypes import FLOAT16  # noqa: E402
from ampaudit.core.finalize import finalize  # noqa: E402
from ampaudit.graph.forward import ExampleInputs  # noqa: E402
from ampaudit.graph.trace import trace_model  # noqa: E402
from ampaudit.load.loader import load_target  # noqa: E402
from ampaudit.report.formats import render_machine  # noqa: E402
from ampaudit.report.terminal import render  # noqa: E402

MODEL = str(ROOT / "bench" / "gpt2_model.py")


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def one_run() -> dict[str, float]:
    loaded, t_load = timed(lambda: load_target(MODEL))
    catalog = build_catalog(Config())
    trace, t_trace = timed(lambda: trace_model(loaded.model, catalog, None))

    report, t_classify = timed(lambda: finalize(analyse(trace, catalog, FLOAT16, file=MODEL, entry=loaded.entry),
                                                Config()))

    def do_report():
        render_machine(report, "json")
        render(report, make_console(io.StringIO(), width=120))

    _, t_report = timed(do_report)
    _, t_bare = timed(lambda: torch.fx.symbolic_trace(loaded.model))
    return {"load": t_load, "trace": t_trace, "classify": t_classify, "report": t_report, "bare_fx": t_bare,
            "nodes": len(report.nodes)}


def ranged_run(model: torch.nn.Module, inputs: ExampleInputs) -> dict[str, float]:
    catalog = build_catalog(Config())
    with torch.no_grad():
        _, t_forward = timed(lambda: model(*inputs.args))
    _, t_check = timed(lambda: finalize(audit_model(model, inputs, catalog, FLOAT16, file=MODEL, entry="GPT"),
                                        Config()))
    return {"forward": t_forward, "check_with_ranges": t_check}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256, help="sequence length of the example input (batch 1)")
    parser.add_argument("--json", action="store_true", help="print the medians as JSON")
    args = parser.parse_args()
    one_run()  # warm-up: imports, first-call caches
    runs = [one_run() for _ in range(args.repeat)]
    med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    check = med["trace"] + med["classify"] + med["report"]
    med["check_no_inputs"] = check
    med["ratio_vs_bare_fx"] = check / med["bare_fx"]

    model = load_target(MODEL).model
    ids = torch.randint(0, 50257, (1, args.tokens))
    inputs = ExampleInputs((ids, ids), {}, "bench")
    ranged_run(model, inputs)  # warm-up
    ranged = [ranged_run(model, inputs) for _ in range(args.repeat)]
    for key in ranged[0]:
        med[key] = statistics.median(r[key] for r in ranged)
    med["ratio_vs_forward"] = med["check_with_ranges"] / med["forward"]
    if args.json:
        print(json.dumps(med, indent=2))
        return
    print(f"GPT-2 small ({int(med['nodes'])} nodes), median of {args.repeat} runs, {torch.get_num_threads()} threads")
    print("without example inputs:")
    for key in ("load", "trace", "classify", "report", "check_no_inputs", "bare_fx"):
        print(f"  {key:<18} {med[key] * 1000:9.1f} ms")
    print(f"  check / bare fx    {med['ratio_vs_bare_fx']:9.2f}x   (target <= 2x)")
    print(f"with example inputs (batch 1 x {args.tokens} tokens), range audit on:")
    for key in ("forward", "check_with_ranges"):
        print(f"  {key:<18} {med[key] * 1000:9.1f} ms")
    print(f"  check / forward    {med['ratio_vs_forward']:9.2f}x   (target <= 3x)")


if __name__ == "__main__":
    main()
