"""What a watched step records of each tensor: an event, ``(module, phase, label)``.

``hooks.StepRecorder`` makes events in eager mode; inside a torch.compile'd region the op of
``compiled`` carries them as numbers (a custom op's arguments are ints), which the recorder
turns back into events. Both read the phases and that numbering here.
"""

from __future__ import annotations

# The gradient w.r.t. a module's input: an event that may be the first non-finite (it is what
# the module's backward made), but in no statistics row - the producer's output gradient
# already counts that tensor.
INPUT_GRAD = "input grad"
# The tensor a backward runs from - the loss, made by the loop's code outside every module: an
# event that may be the first non-finite (a loss that is NaN while its gradients stay finite, as
# F.cross_entropy over a batch whose every label is ignored), in no statistics row either.
LOSS = "loss"
NO_ROW = (INPUT_GRAD, LOSS)  # the phases only the first non-finite reads
LOSS_MODULE = "(loss)"  # its module in the events

# A traced tensor's kind, as the compiled op carries it: (phase, label); "{}" is the tensor's
# index among the module's.
KINDS = (("forward", "output"), ("forward", "output[{}]"), ("eval", "output"), ("eval", "output[{}]"),
         ("backward", "grad of output"), ("backward", "grad of output[{}]"), (INPUT_GRAD, "grad of input[{}]"))
FORWARD, EVAL, GRAD_OUTPUT, GRAD_INPUT = 0, 2, 4, 6  # KINDS[k] one tensor; KINDS[k + 1] one of several


def event(kind: int, index: int) -> tuple[str, str]:
    """The (phase, label) of a tensor of ``kind`` (``KINDS``), the ``index``-th of its module's."""
    phase, label = KINDS[kind]
    return phase, label.format(index)
