"""What the blame and the summary say of a NaN the loss code made (``loss_probe``) - without
torch: ``ampaudit report`` reads them from a log."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ampaudit.watch.provenance import Origin

# the blame's words for a bad gradient that came into the model from the loop's code (``blame``)
FROM_THE_LOSS = "it came into the model already non-finite: from the loss or the code after the model"


def from_the_loss(first: dict[str, Any] | None) -> bool:
    """Whether a step's first non-finite came from the loss code, its op not named yet."""
    return bool(first) and not first.get("op") and str(first.get("note", "")).startswith(FROM_THE_LOSS)


def named(first: dict[str, Any], origin: Origin) -> dict[str, Any]:
    """``first`` (from the loss) with the call of the loss code that made it: the one that
    made -inf by arithmetic, where a later call turned that into NaN (``0 * log(0)``).
    ``loss_code``: named by the probe (``named_later`` reads it)."""
    note = "it came into the model already non-finite: the loss code made it"
    if origin.minus_inf is not None:
        then = f"{origin.op} at {origin.file}:{origin.line}" if origin.file else origin.op
        note = f"{note}, -inf by arithmetic (a log of 0, say), which {then} turned into NaN or +inf"
        origin = origin.minus_inf
    return {**first, "op": origin.op, **({"source": f"{origin.file}:{origin.line}"} if origin.file else {}),
            "note": note, "loss_code": True}


def named_later(first: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """The run's first non-finite, from the loss, named by a later step's probe (``later``)."""
    return {**first, "op": later["op"], **({"source": later["source"]} if "source" in later else {}),
            "note": f"{later['note']} (named at step {later['step']}, where it happened again)", "loss_code": True}
