"""``ampaudit check FILE.py`` against ``check FILE.py --lint-only`` on a folder of training
scripts: whole processes, rounds interleaved, per file the median of its rounds.

    python bench/check_vs_lint.py FOLDER [--rounds 5] [--pythonpath OTHER_CHECKOUT]

A training script whose top level runs code is not imported (AMP003); ``check`` should then
cost what the lint costs (issue 27 item 10: at most 1.3x). Prints each file's times and what
check made of it (``not-imported``: AMP003; ``lint-only``: no model entry point; ``graph``: an
audit ran or was tried), then the median and max ratio per group. ``--pythonpath`` times
another checkout (an older commit, exported with ``git archive``) in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(path: Path, lint_only: bool, pythonpath: str) -> tuple[float, dict]:
    argv = [sys.executable, "-m", "ampaudit", "check", str(path), "--format", "json", "--fail-on", "never"]
    if lint_only:
        argv.append("--lint-only")
    env = {**os.environ, "PYTHONPATH": pythonpath}
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=pythonpath, timeout=600)
    elapsed = time.perf_counter() - start
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        report = {}
    return elapsed, report


def _kind(report: dict) -> str:
    rules = {f.get("rule") for f in report.get("findings", [])}
    if "AMP003" in rules:
        return "not-imported"
    notes = " ".join(report.get("target", {}).get("notes", []))
    return "lint-only" if "training-script lint only: no model entry point" in notes else "graph"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pythonpath", help="another checkout to time in the same rounds (its root)")
    args = parser.parse_args()
    files = sorted(args.folder.glob("*.py"))
    checkouts = {"this": str(ROOT)} | ({"other": str(Path(args.pythonpath).resolve())} if args.pythonpath else {})
    times: dict[tuple[str, str, Path], list[float]] = {}
    kinds: dict[Path, str] = {}
    for _ in range(args.rounds):
        for path in files:
            for name, where in checkouts.items():  # interleaved: check, lint, check of the other...
                for mode in ("check", "lint"):
                    elapsed, report = _run(path, mode == "lint", where)
                    times.setdefault((name, mode, path), []).append(elapsed)
                    if name == "this" and mode == "check":
                        kinds[path] = _kind(report)
    ratios: dict[tuple[str, str], list[float]] = {}
    for path in files:
        row = [f"{path.name[:60]:60}", f"{kinds[path]:12}"]
        for name in checkouts:
            check = statistics.median(times[(name, "check", path)])
            lint = statistics.median(times[(name, "lint", path)])
            ratios.setdefault((name, kinds[path]), []).append(check / lint)
            row.append(f"{name}: check {check:6.2f} s lint {lint:5.2f} s ({check / lint:4.2f}x)")
        print("  ".join(row))
    print()
    for (name, kind), values in sorted(ratios.items()):
        print(f"{name:6} {kind:12} {len(values):3} files: check / lint-only median {statistics.median(values):.2f}x, "
              f"max {max(values):.2f}x")


if __name__ == "__main__":
    main()
