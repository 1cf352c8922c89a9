"""Running the model once on example inputs: the inputs' container, the fp32 no-grad
forward every audit starts from, and turning its failures into one-line errors."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ampaudit.core.errors import USER_CODE_ERRORS, LoadError
from ampaudit.core.kept_attributes import attributes_kept
from ampaudit.core.paths import display_path
from ampaudit.core.tensors import has_tensor, iter_tensors
from ampaudit.core.userframe import traceback_location


@dataclass
class ExampleInputs:
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    origin: str = ""  # where they came from, for messages: "example_inputs()", "--input-shape"

    @classmethod
    def coerce(cls, value: Any, origin: str) -> ExampleInputs:
        """A tuple/list of positional args, a dict of kwargs, or a single tensor."""
        if isinstance(value, ExampleInputs):
            return value
        if _nested_deeper_than(value, MAX_NESTING):
            raise LoadError(f"{origin} gave containers nested more than {MAX_NESTING} deep: ampaudit follows "
                            "tuples, lists and dicts of tensors up to that depth")
        if isinstance(value, dict):
            return cls((), dict(value), origin)
        if isinstance(value, (tuple, list)):
            return cls(tuple(value), {}, origin)
        if isinstance(value, torch.Tensor):
            return cls((value,), {}, origin)
        raise LoadError(
            f"{origin} gave {type(value).__name__}; expected a tuple of positional arguments, "
            "a dict of keyword arguments, or a tensor"
        )


MAX_NESTING = 32  # tuples, lists and dicts inside one another: deeper is no model's input, and recursion ends


def _nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value``'s tuples, lists and dicts nest more than ``limit`` deep (no recursion)."""
    stack, seen = [(value, 0)], set()
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (tuple, list, dict)) or id(item) in seen:
            continue
        if depth >= limit:
            return True
        seen.add(id(item))
        stack += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return False


def refuse_meta(model: torch.nn.Module, inputs: ExampleInputs | None, remedy: str) -> None:
    """Meta tensors have shapes but no values: nothing can run on them or be measured."""
    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        raise LoadError(f"the model's weights are meta tensors (no values): they cannot run; {remedy}")
    if inputs is not None and any(t.is_meta for t in iter_tensors((inputs.args, inputs.kwargs))):
        raise LoadError(f"the example inputs ({inputs.origin}) are meta tensors (no values): they cannot run; "
                        f"{remedy}")


def describe_exception(exc: BaseException) -> str:
    """``ValueError: msg (model.py:12)`` - the first line of the message and the user's line;
    ``exit(4) (model.py:12)`` for a call to exit()."""
    if isinstance(exc, SystemExit):
        where = traceback_location(exc.__traceback__)
        return f"exit({exc.code!r})" + (f" ({display_path(where[0])}:{where[1]})" if where else "")
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    where = traceback_location(exc.__traceback__)
    suffix = f" ({display_path(where[0])}:{where[1]})" if where else ""
    return f"{type(exc).__name__}: {text}{suffix}" if text else f"{type(exc).__name__}{suffix}"


@contextlib.contextmanager
def failures_explained(model: torch.nn.Module, inputs: ExampleInputs | None) -> Iterator[None]:
    """A run of ``model`` on ``inputs`` that failed (the LoadError ``run_model`` and the range
    probe raise) says so where train mode would have run it (``_train_mode_hint``)."""
    try:
        yield
    except LoadError as exc:
        if inputs is None or not str(exc).startswith(f"the example inputs ({inputs.origin}) fail to run the model"):
            raise
        hint = _train_mode_hint(model, inputs)
        if not hint:
            raise
        raise LoadError(f"{exc}{hint}") from exc.__cause__


def _train_mode_hint(model: torch.nn.Module, inputs: ExampleInputs) -> str:
    """Where a forward that failed in eval mode (the audit's: no dropout draws) runs in train
    mode - an ``if self.training:`` branch, LlamaGen's eval path reading a kv cache's positions -
    the error says so, or it reads as the user's bug."""
    if model.training:
        return ""
    # a train-mode forward updates BatchNorm's running statistics in place: put back after
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.no_grad(), attributes_kept(model), torch.random.fork_rng(devices=[]):
            model.train()
            model(*inputs.args, **inputs.kwargs)
    except USER_CODE_ERRORS:  # only a hint: any failure in train mode (exit() included) means none
        return ""
    finally:
        model.eval()
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
    return (" - in eval mode, which the audit runs it in (no dropout draws); in train mode it runs: its forward "
            "takes another branch in eval. Audit a model whose eval forward takes the training path (get_model() "
            "returning a wrapper that runs it in train mode, its dropout at 0)")


def run_model(
    model: torch.nn.Module, inputs: ExampleInputs, runner: Callable[[], Any] | None = None
) -> Any:
    """Run one forward in fp32 without autograd; bad inputs or outputs become a LoadError.

    ``runner`` replaces the plain call (the recorder runs the model itself); whatever it
    returns is passed through, and the model output is expected as its last element.
    """
    try:
        with torch.no_grad(), attributes_kept(model):
            result = runner() if runner is not None else model(*inputs.args, **inputs.kwargs)
    except USER_CODE_ERRORS as exc:
        raise LoadError(f"the example inputs ({inputs.origin}) fail to run the model: "
                        f"{describe_exception(exc)}") from exc
    output = result[-1] if runner is not None else result
    if not has_tensor(output):
        raise LoadError(
            f"the model's output holds no tensor (got {type(output).__name__}): "
            "ampaudit audits models whose forward returns tensors"
        )
    return result
