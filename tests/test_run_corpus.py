"""The property ``ampaudit run`` promises: a training script trains under it exactly as under
``python script.py`` - the same exit code, the same stdout, bit-identical final weights.

The corpus (fixtures/trainers/transparent/) is our own code shaped like real trainers: DataLoader
workers, fork pools and os.fork, threads training at once, torch.func, activation checkpointing
and a resumed checkpoint, optimizers that take closures, two optimizers with one GradScaler,
Muon and AdamW stepping after one backward, torch.compile - under ``run``, and in the slow tier
under ``run --probe-loss`` (the loss probe on from the first step). Each script saves its weights to
./weights.pt; processes that share stdout print each line in one write (under PYTHONUNBUFFERED
print writes its words one by one). The summary at exit says what the log says: its steps,
eval forwards and each parameter's last norm."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

CORPUS = ROOT / "fixtures" / "trainers" / "transparent"
SCRIPTS = sorted(p.name for p in CORPUS.glob("*.py"))


def test_the_corpus_is_there():
    assert len(SCRIPTS) >= 5


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the corpus forks")
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_trains_under_run_as_it_does_under_python(tmp_path, script):
    out, codes = _side_by_side(tmp_path, script, {"watched": ["run", "--log", "w.jsonl"]})
    (plain_out, plain_err), (watched_out, watched_err) = out["plain"], out["watched"]
    assert codes["watched"] == codes["plain"], watched_err
    assert watched_out == plain_out, watched_err
    # the summary, and no traceback but the script's own (one script fails on purpose)
    assert "ampaudit watch" in watched_err and watched_err.count("Traceback") == plain_err.count("Traceback")
    # and the log says what the summary at exit said (evaluation after the last step included)
    from ampaudit.watch.summary import read_log

    logged = read_log(tmp_path / "watched" / "w.jsonl").summary()
    assert f"│ steps             {logged['steps']} " in watched_err
    evals = logged["eval_forwards"]["count"]
    assert (f"│ eval forwards     {evals} with grad disabled" in watched_err) == (evals > 0), watched_err
    # each parameter's last gradient norm as the log has it (two optimizers: each step holds one's)
    table = watched_err[watched_err.index("Parameter gradients"):].splitlines()
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in table if line.startswith("│ ")}
    assert {name: rows.get(name) for name in logged["params"]} == \
           {name: "" if s["norm"] is None else f"{s['norm']:.3g}" for name, s in logged["params"].items()}
    _same_weights(tmp_path, "watched")


@pytest.mark.slow  # the default run has the corpus under `run`; this is the probe on top of it
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the corpus forks")
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_trains_under_run_with_the_loss_probe_as_it_does_under_python(tmp_path, script):
    """``run --probe-loss``: a torch function mode over the loop's own code on every step."""
    out, codes = _side_by_side(tmp_path, script, {"probed": ["run", "--probe-loss", "--log", "w.jsonl"]})
    assert (codes["probed"], out["probed"][0]) == (codes["plain"], out["plain"][0]), out["probed"][1]
    _same_weights(tmp_path, "probed")


def _side_by_side(tmp_path, script: str, runs: dict[str, list[str]]) -> tuple[dict, dict]:
    """``script`` under python and under each ampaudit command line of ``runs``, side by side
    (each starts an interpreter and imports torch), each in a folder of its own: their
    (stdout, stderr) and exit codes by name."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    path = str(CORPUS / script)
    commands = {"plain": [sys.executable, path],
                **{name: [sys.executable, "-m", "ampaudit", *args, path] for name, args in runs.items()}}
    procs = {}
    for name, command in commands.items():
        (tmp_path / name).mkdir()
        procs[name] = subprocess.Popen(command, cwd=tmp_path / name, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    out = {name: proc.communicate(timeout=180) for name, proc in procs.items()}
    return out, {name: proc.returncode for name, proc in procs.items()}


def _same_weights(tmp_path, name: str) -> None:
    """The weights ``name``'s run saved are the plain run's, bit for bit."""
    import torch

    plain = torch.load(tmp_path / "plain" / "weights.pt")
    watched = torch.load(tmp_path / name / "weights.pt")
    assert list(watched) == list(plain)
    assert all(torch.equal(watched[k], plain[k]) for k in plain), name

