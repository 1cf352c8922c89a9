"""Example inputs: from the user's file, from ``--input-shape``, and running the model on them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ampaudit.core.errors import LoadError, UsageError
from ampaudit.core.paths import display_path
from ampaudit.graph.userframe import traceback_location

INPUT_FUNCTIONS = ("example_inputs", "get_example_inputs")


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


_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "float64": torch.float64, "int64": torch.int64, "long": torch.int64,
    "int32": torch.int32, "int": torch.int32, "bool": torch.bool,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.lower().removeprefix("torch.")]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r} (expected one of {', '.join(sorted(_DTYPES))})") from None


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--input-shape {text!r}: expected comma-separated sizes such as 8,3,32,32") from None
    if not dims or any(d < 0 for d in dims):
        raise UsageError(f"--input-shape {text!r}: expected comma-separated sizes such as 8,3,32,32")
    return dims


def from_shapes(shapes: Sequence[str], dtypes: Sequence[str] = ()) -> ExampleInputs:
    """Random tensors, one positional argument per ``--input-shape``.

    Integer inputs are drawn from {0, 1} so they index any embedding table.
    """
    if dtypes and len(dtypes) not in (1, len(shapes)):
        raise UsageError(f"give one --input-dtype, or one per --input-shape ({len(shapes)})")
    generator = torch.Generator().manual_seed(0)
    args = []
    for index, text in enumerate(shapes):
        shape = parse_shape(text)
        dtype = parse_dtype(dtypes[index if len(dtypes) > 1 else 0]) if dtypes else torch.float32
        if dtype.is_floating_point:
            args.append(torch.randn(shape, generator=generator).to(dtype))
        elif dtype is torch.bool:
            args.append(torch.ones(shape, dtype=torch.bool))
        else:
            args.append(torch.randint(0, 2, shape, generator=generator, dtype=dtype))
    return ExampleInputs(tuple(args), {}, "--input-shape")


def has_tensor(value: Any) -> bool:
    """Whether a (nested) output holds a tensor; dict subclasses such as HF's ModelOutput count."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(has_tensor(v) for v in value)
    return False


def describe_exception(exc: BaseException) -> str:
    """``ValueError: msg (model.py:12)`` - the first line of the message and the user's line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    where = traceback_location(exc.__traceback__)
    suffix = f" ({display_path(where[0])}:{where[1]})" if where else ""
    return f"{type(exc).__name__}: {text}{suffix}" if text else f"{type(exc).__name__}{suffix}"


def run_model(
    model: torch.nn.Module, inputs: ExampleInputs, runner: Callable[[], Any] | None = None
) -> Any:
    """Run one forward in fp32 without autograd; bad inputs or outputs become a LoadError.

    ``runner`` replaces the plain call (the recorder runs the model itself); whatever it
    returns is passed through, and the model output is expected as its last element.
    """
    try:
        with torch.no_grad():
            result = runner() if runner is not None else model(*inputs.args, **inputs.kwargs)
    except Exception as exc:
        raise LoadError(f"the example inputs ({inputs.origin}) fail to run the model: "
                        f"{describe_exception(exc)}") from exc
    output = result[-1] if runner is not None else result
    if not has_tensor(output):
        raise LoadError(
            f"the model's output holds no tensor (got {type(output).__name__}): "
            "ampaudit audits models whose forward returns tensors"
        )
    return result
