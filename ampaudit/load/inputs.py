"""Example inputs as the user gives them: ``--input-shape`` / ``--input-dtype`` on the command
line, or a function in the model file (its names are here; the loader calls it)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ampaudit.core.errors import UsageError
from ampaudit.graph.forward import ExampleInputs

INPUT_FUNCTIONS = ("example_inputs", "get_example_inputs")

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
