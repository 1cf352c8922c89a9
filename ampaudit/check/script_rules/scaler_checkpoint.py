"""AMP449: the checkpoint saves and restores the optimizer's state but not the GradScaler's:
every resume starts the loss scale over at its initial value."""

from __future__ import annotations

import re
from collections.abc import Iterator

from ampaudit.check.lint.facts import GRAD_SCALERS, Assignment, Call, ScriptFacts
from ampaudit.check.lint.nodes import arguments, dotted
from ampaudit.check.lint.protocol import finding, named_like_optimizer, optimizers
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Finding

# a call that may checkpoint the scaler elsewhere: save_checkpoint(..., scaler), torch.save(scaler, ...)
_CHECKPOINTS = re.compile(r"save|checkpoint|ckpt|resume|load", re.IGNORECASE)
_SCALER_NAME = re.compile(r"scaler", re.IGNORECASE)
# a call that may restore the optimizer's state elsewhere: smart_resume(ckpt, optimizer), load_checkpoint(...)
_RESTORES = re.compile(r"resume|load|restore", re.IGNORECASE)


@lint_rule("AMP449", reads=("state_dict", "GradScaler", "scaler"))
def scaler_state_not_checkpointed(facts: ScriptFacts) -> Iterator[Finding]:
    restored = [c for c in facts.method_calls("load_state_dict") if _of_optimizer(facts, c)]
    restored += _restore_helpers(facts)
    # optimizer.load_state_dict(optimizer.state_dict()) copies state around: no checkpoint
    copied = {id(a) for c in restored for a in c.node.args}
    saved = [c for c in facts.method_calls("state_dict") if _of_optimizer(facts, c) and id(c.node) not in copied]
    if not saved or not restored or not _saves(facts):
        return
    scalers = [c.receiver for scope in facts.scopes() for c in facts.calls_in(scope)
               if c.method == "scale" and c.feeds_backward and c.receiver in facts.scalers(scope)]
    scalers += [a.target for a in _built_scalers(facts)]
    if not scalers or _scaler_checkpointed(facts, set(scalers)):
        return
    first = saved[0]
    yield finding(facts, "AMP449", first, optimizer=first.receiver, scaler=scalers[0],
                  fix=f'save {scalers[0]}.state_dict() beside the optimizer\'s ("scaler": ...) and call '
                      f"{scalers[0]}.load_state_dict(...) where the optimizer's state is restored")


def _restore_helpers(facts: ScriptFacts) -> list[Call]:
    """Calls that hand the optimizer to a function that may restore it - yolov5's
    ``smart_resume(ckpt, optimizer, ...)``, ``load_checkpoint(path, model, optimizer)``: the
    restore is in another file."""
    found = []
    for call in facts.calls:
        callee = (dotted(call.node.func) or "").rsplit(".", 1)[-1]
        if call.method == "load_state_dict" or not _RESTORES.search(callee):
            continue
        if any(_names_optimizer(facts, dotted(a.value), call) for a in arguments(call.node)):
            found.append(call)
    return found


def _saves(facts: ScriptFacts) -> bool:
    """Something is written: torch.save, save_on_master, accelerator.save, save_checkpoint..."""
    return any("save" in (dotted(c.node.func) or "").rsplit(".", 1)[-1].lower() for c in facts.calls)


def _of_optimizer(facts: ScriptFacts, call: Call) -> bool:
    return _names_optimizer(facts, call.receiver, call)


def _names_optimizer(facts: ScriptFacts, name: str | None, call: Call) -> bool:
    """``name``, in ``call``'s scope, is an optimizer: named like one, or built as one there."""
    return name is not None and (named_like_optimizer(name) or name in optimizers(facts, call.scope))


def _built_scalers(facts: ScriptFacts) -> list[Assignment]:
    return [a for a in facts.assigned(GRAD_SCALERS) if not a.call.disabled]


def _scaler_checkpointed(facts: ScriptFacts, scalers: set[str]) -> bool:
    """The scaler's state is read or restored (``scaler.state_dict()``, ``load_state_dict``),
    or the scaler goes to a function that may checkpoint it (``save_checkpoint(..., scaler)``)."""
    names = scalers | {s.rsplit(".", 1)[-1] for s in scalers}
    for call in facts.calls:
        receiver = call.receiver or ""
        if call.method in ("state_dict", "load_state_dict") and (
                receiver in names or receiver.rsplit(".", 1)[-1] in names or _SCALER_NAME.search(receiver)):
            return True
        callee = dotted(call.node.func) or ""
        if _CHECKPOINTS.search(callee.rsplit(".", 1)[-1]) and any(
                (dotted(a) or "").rsplit(".", 1)[-1] in names for a in (*call.node.args,
                                                                       *(k.value for k in call.node.keywords))):
            return True
    return False
