"""Example inputs as the user gives them: ``--input-shape`` / ``--input-dtype`` on the command
line, or a function in the model file (its names are here; the loader calls it)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ampaudit.core.errors import UsageError
from ampaudit.graph.forward import ExampleInputs

INPUT_FUNCTIONS = ("example_inputs", "get_example_inputs")
SEQUENCE = (2, 8)  # batch, tokens of the default token-id inputs

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
        try:
            if dtype.is_floating_point:
                args.append(torch.randn(shape, generator=generator).to(dtype))
            elif dtype is torch.bool:
                args.append(torch.ones(shape, dtype=torch.bool))
            else:
                args.append(torch.randint(0, 2, shape, generator=generator, dtype=dtype))
        except (RuntimeError, MemoryError):  # more elements than memory (or than a tensor may hold)
            size = math.prod(shape) * dtype.itemsize
            raise UsageError(f"--input-shape {text}: {size / 2**30:,.1f} GiB of {str(dtype).removeprefix('torch.')} "
                             "cannot be allocated here") from None
    return ExampleInputs(tuple(args), {}, "--input-shape")


def default_inputs(model: torch.nn.Module) -> ExampleInputs | None:
    """Example inputs for a model named without a file that gives them, from its type: token
    ids for a transformers language model or a model whose first layer is an Embedding, images
    for a transformers or timm vision model or a model whose first layer is a Conv2d; None when
    the type says nothing."""
    generator = torch.Generator().manual_seed(0)
    config = getattr(model, "config", None)
    main = getattr(model, "main_input_name", None)
    text, vision = getattr(config, "text_config", None), getattr(config, "vision_config", None)
    if text is not None and vision is not None and getattr(text, "vocab_size", None):  # CLIP, SigLIP
        size = getattr(vision, "image_size", 224)
        shape = (SEQUENCE[0], getattr(vision, "num_channels", 3), size, size)
        kwargs = {"input_ids": torch.randint(0, text.vocab_size, SEQUENCE, generator=generator),
                  "pixel_values": torch.randn(shape, generator=generator), "return_loss": True}
        return ExampleInputs((), kwargs, f"token ids {SEQUENCE[0]}x{SEQUENCE[1]} and images {'x'.join(map(str, shape))}"
                                         ", the default for a text-image model (its contrastive loss)")
    if config is not None and main == "input_ids":
        vocab = getattr(config, "vocab_size", None) or 2
        kwargs = {"input_ids": torch.randint(0, vocab, SEQUENCE, generator=generator)}
        if getattr(config, "is_encoder_decoder", False):
            kwargs["decoder_input_ids"] = torch.randint(0, vocab, SEQUENCE, generator=generator)
        return ExampleInputs((), kwargs, f"token ids {SEQUENCE[0]}x{SEQUENCE[1]}, the default for a language model")
    if config is not None and main == "input_features":  # speech: log-mel frames (Whisper)
        shape = (SEQUENCE[0], getattr(config, "num_mel_bins", 80), 2 * getattr(config, "max_source_positions", 1500))
        kwargs = {"input_features": torch.randn(shape, generator=generator)}
        if getattr(config, "is_encoder_decoder", False):
            vocab = getattr(config, "vocab_size", None) or 2
            kwargs["decoder_input_ids"] = torch.randint(0, vocab, SEQUENCE, generator=generator)
        return ExampleInputs((), kwargs, f"log-mel features {'x'.join(map(str, shape))} and decoder token ids "
                                         f"{SEQUENCE[0]}x{SEQUENCE[1]}, the default for a speech model")
    if config is not None and main == "input_values":  # raw audio: wav2vec2, HuBERT, WavLM
        strides = getattr(config, "conv_stride", None) or (320,)
        samples = 5 * math.prod(strides)  # a few frames past the feature encoder's downsampling
        values = torch.randn((SEQUENCE[0], samples), generator=generator)
        return ExampleInputs((), {"input_values": values}, f"raw audio {SEQUENCE[0]}x{samples}, the default for a "
                                                            "speech model")
    if config is not None and main == "pixel_values":
        size = getattr(config, "image_size", 224)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        shape = (2, getattr(config, "num_channels", 3), *size)
        return ExampleInputs((), {"pixel_values": torch.randn(shape, generator=generator)},
                             f"images {'x'.join(map(str, shape))}, the default for a vision model")
    timm_cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    if isinstance(timm_cfg, dict) and len(timm_cfg.get("input_size", ())) == 3:
        shape = (1, *timm_cfg["input_size"])
        return ExampleInputs((torch.randn(shape, generator=generator),), {},
                             f"images {'x'.join(map(str, shape))}, the model's input_size")
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if isinstance(first, torch.nn.Embedding):
        ids = torch.randint(0, first.num_embeddings, SEQUENCE, generator=generator)
        return ExampleInputs((ids,), {}, f"token ids {SEQUENCE[0]}x{SEQUENCE[1]}, the default for a model that "
                                         "starts with an Embedding")
    if isinstance(first, torch.nn.Conv2d):
        shape = (1, first.in_channels, 224, 224)
        return ExampleInputs((torch.randn(shape, generator=generator),), {},
                             f"images {'x'.join(map(str, shape))}, the default for a model that starts with a Conv2d")
    return None

