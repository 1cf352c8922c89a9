"""What the blame and the summary say of a NaN the loss code made (``loss_probe``) - without
torch: ``ampaudit report`` reads them from a log."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ampaudit.watch.events import LOSS

if TYPE_CHECKING:
    from ampaudit.watch.provenance import Origin

# the blame's words (``blame``) for a NaN the loop's code made: a bad gradient that came into the model
# from it (FROM_THE_LOSS), or the loss itself (LOSS_ITSELF, LOSS_SCALED, then LOSS_ALONE or LOSS_SPREAD)
FROM_THE_LOSS = "it came into the model already non-finite: from the loss or the code after the model"
LOSS_ITSELF = "the loss was non-finite, made by the loop's code outside every watched module"
LOSS_SCALED = ("the scaled loss was non-finite: a loss scale too high for it, or a loss non-finite before the "
               "scaling, made by the loop's code outside every watched module")
LOSS_ALONE = ("; every gradient watch read stayed finite - a mean over no elements does that (F.cross_entropy over "
              "a batch whose every label is ignored: 0/0 = NaN, zero gradients), and so does a loop that replaces "
              "non-finite gradients before the optimizer step (nan_to_num on .grad, as StyleGAN's does)")
LOSS_SPREAD = "; its gradients made the model's non-finite too"


# said of a NaN from the loss the probe has not named (yet) in a run without ``probe_loss``: the
# probe, armed by it, names it only where it happens again with finite weights
TO_NAME_IT = " (to name its line where it does not happen again: `ampaudit run --probe-loss`, watch(probe_loss=True))"



PENALTY = "it came into the model from the backward of a gradient the loop took with create_graph=True"
# said of it where the probe replayed the loss code's backward from that gradient and it stayed finite
INSIDE_THE_PENALTY = (" (replayed from that gradient, the loss code's own backward made no NaN or Inf: it was made in "
                      "the double backward inside the model - that gradient's graph through the model's modules -, "
                      "which no replay runs, so the op is not known)")


def double_backward(loc: Any) -> str:
    """Said of a bad gradient that arrived at a module's output, not made by any module, on a step
    that took a gradient with create_graph=True (``loc``: its line)."""
    return (f"{PENALTY} ({loc[0]}:{loc[1]}: a gradient penalty) - the loss code's backward, which runs through "
            "that gradient's own graph and brings the model's activations gradients their consumers did not make")


def from_the_loss(first: dict[str, Any] | None) -> bool:
    """Whether a step's first non-finite was made by the loop's code - the loss itself, or what
    the blame traced to it (``made_in``: not without provenance) -, its op not named yet."""
    return bool(first) and (first.get("made_in") == "loss" or first.get("phase") == LOSS) and not first.get("op")


# said instead under ``probe_loss`` once torch.compile stopped the probe
COMPILED = " (the loss probe stopped when torch.compile compiled a graph: its mode would change what dynamo traces)"
# and in a distributed run, where it never starts: each rank's loss code is its own
ACROSS_RANKS = " (probe_loss does not run across processes: each rank's loss code is its own)"



def dropped_calls(dropped: int, kept: int, mb: int) -> str:
    """Said of a NaN from the loss the probe did not name on a step where it dropped calls: the one
    that made it may be among them (``probe_budget``)."""
    return (f" (the loss probe kept only the step's latest {kept} calls of the loss code, {dropped} dropped over "
            f"{mb} MiB of what they made or 512 calls: the call that made it may be one of those; "
            "a larger probe_loss_mb, `--probe-loss-mb`, keeps more)")


def unnamed(first: dict[str, Any], why: str = TO_NAME_IT) -> dict[str, Any]:
    """``first``, not named by the probe, with why (once): how to name it, or why it was not."""
    note = str(first.get("note", ""))
    return first if note.endswith(why) else {**first, "note": note + why}


def named(first: dict[str, Any], origin: Origin, backward: bool = False) -> dict[str, Any]:
    """``first`` (from the loss) with the call of the loss code that made it: the one that
    made -inf by arithmetic, where a later call turned that into NaN (``0 * log(0)``); with
    ``backward``, the autograd node whose backward made NaN/Inf of finite gradients."""
    how = "NaN or Inf out of finite values"
    if backward:
        how = f"its backward made NaN or Inf of finite gradients, its value finite ({origin.note or origin.op})"
    elif origin.minus_inf is not None:
        then = f"{origin.op} at {origin.file}:{origin.line}" if origin.file else origin.op
        how = f"-inf by arithmetic (a log of 0, say), which {then} turned into NaN or +inf"
        origin = origin.minus_inf
    if first.get("phase") == LOSS:  # the loss event's note: LOSS_ITSELF or LOSS_SCALED, then what its gradients did
        # named, the call says which it was (a GradScaler's multiplication is a call at scaler.scale's line)
        said = str(first.get("note", LOSS_ITSELF))
        rest = said[len(LOSS_SCALED if said.startswith(LOSS_SCALED) else LOSS_ITSELF):]
        note = f"{LOSS_ITSELF} ({how}){rest}"
    elif str(first.get("note", "")).startswith(PENALTY):  # through a gradient penalty's graph: said so
        note = f"{str(first['note']).partition(' - ')[0]}, made by the loss code: {how}"
    else:
        note = f"it came into the model already non-finite, made by the loss code: {how}"
    return {**first, **origin.to_dict(), "note": note}


def named_later(first: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """The run's first non-finite, from the loss, named by a later step's probe (``later``)."""
    return {**first, "op": later["op"], **({"source": later["source"]} if "source" in later else {}),
            "note": f"{later['note']} (named at step {later['step']}, where it happened again)"}
