"""Models whose weights are already fp16 or bf16 (``from_pretrained(..., torch_dtype=torch.bfloat16)``,
``model.half()``): convert works on an fp32 copy of them.

The plan runs norms and losses in fp32 on fp32 inputs; weights left in bf16 beside them fail to
run ("mixed dtype (CPU): expect parameter to have scalar type of Float"), and a bf16 weight has no
fp32 master to train. The copy's weights are the low values made fp32 exactly - what fp32 masters
of them are - and the user's model is not touched."""

from __future__ import annotations

import torch

from ampaudit.core.dtypes import LowDtype
from ampaudit.core.rulebook import rule
from ampaudit.graph.forward import ExampleInputs
from ampaudit.graph.model_copy import copy_model
from ampaudit.graph.tree import map_tensors

_LOW = (torch.float16, torch.bfloat16)


def low_weight_dtypes(model: torch.nn.Module) -> list[str]:
    """The fp16/bf16 dtypes among the model's parameters and buffers ("bfloat16", "float16")."""
    found = {t.dtype for t in (*model.parameters(), *model.buffers()) if t.dtype in _LOW}
    return sorted(str(d).removeprefix("torch.") for d in found)


def fp32_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` with every fp16/bf16 parameter and buffer made fp32 in place
    (as ``Module.to`` does: tied tensors stay one tensor; fp64 and integer ones stay as they are)."""
    work = copy_model(model)
    with torch.no_grad():
        for tensor in {id(t): t for t in (*work.parameters(), *work.buffers())}.values():
            if tensor.dtype in _LOW:
                tensor.data = tensor.data.float()
    return work


def fp32_inputs(inputs: ExampleInputs) -> ExampleInputs:
    """The example inputs for the fp32 copy: float tensors made in the weights' low dtype
    (Whisper's bf16 log-mel features for a bf16 checkpoint) made fp32, as the copy's weights are
    (a bf16 input into the copy's fp32 Conv1d raised "Input type (c10::BFloat16) and bias type
    (float) should be the same")."""
    def up(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype in _LOW else t

    return ExampleInputs(map_tensors(inputs.args, up), map_tensors(inputs.kwargs, up), inputs.origin)


def low_weight_notes(found: list[str], low: LowDtype) -> list[str]:
    """What the summary says of a model converted from low-precision weights; for bf16 weights
    converted for fp16, AMP103's point (bf16-trained weights may overflow fp16)."""
    if not found:
        return []
    notes = [f"the model's weights are {' and '.join(found)}: converted from an fp32 copy of them (fp32 weights "
             "and masters hold the same values; the model passed in is not modified)"]
    info = rule("AMP103")
    overflow = [d for d in found if d in info.params["trained"]]
    if overflow and low.name in info.params["audited"]:
        risk = info.message.split(": ", 1)[-1]
        notes.append(f"AMP103: the weights are {overflow[0]} and this conversion is for {low.name}: {risk}")
    return notes
