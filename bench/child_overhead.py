"""Benchmark: what running the model in a child process (core/child.py) adds to ``ampaudit check``.

For each target, interleaved rounds of two fresh interpreters doing the same work:

- *child*: ``ampaudit check TARGET --format json`` - the parent lints and renders, the child
  imports torch and the model, traces and measures;
- *in-process*: the same audit through the Python API in one process
  (``check_path(TARGET)`` rendered as JSON), as ``ampaudit check`` ran before the boundary.

Wall time of each whole process, median of the rounds; the JSON of both is compared byte for
byte on the first round.

Run: python bench/child_overhead.py [--rounds N] [TARGET ...]
(default targets: the README's example and hf:gpt2)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TARGETS = ["fixtures/models/clean_transformer.py", "hf:gpt2"]
IN_PROCESS = ("import sys; from ampaudit.check.api import check_path; from ampaudit.report.formats import "
              "render_machine; sys.stdout.write(render_machine(check_path(sys.argv[1]), 'json'))")


def timed(argv: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return elapsed, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", default=DEFAULT_TARGETS)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    variants = {"child": [sys.executable, "-m", "ampaudit", "check", "{t}", "--format", "json"],
                "in-process": [sys.executable, "-c", IN_PROCESS, "{t}"]}
    for target in args.targets:
        times: dict[str, list[float]] = {name: [] for name in variants}
        outputs: dict[str, str] = {}
        for _ in range(args.rounds):
            for name, argv in variants.items():  # interleaved: load drifts hit both alike
                elapsed, out = timed([a.format(t=target) for a in argv])
                times[name].append(elapsed)
                outputs.setdefault(name, out)
        child, inproc = (statistics.median(times[n]) for n in variants)
        same = "identical" if outputs["child"] == outputs["in-process"] else "DIFFERENT"
        print(f"{target}: child {child:.2f} s, in-process {inproc:.2f} s (median of {args.rounds}): "
              f"{child - inproc:+.2f} s, {100 * (child / inproc - 1):+.1f}%; JSON {same}")
        print("  rounds:", {n: [round(t, 2) for t in ts] for n, ts in times.items()})


if __name__ == "__main__":
    main()
