"""The file ``convert --dtype fp8 --emit torchao`` writes, as text to format (``convert/fp8.py``
fills it): standalone - torch and torchao only - so that a user runs or imports it without
ampaudit. Its recipe part is torchao's float8 training (``Float8LinearConfig``) or its MXFP8
training (``MXFP8TrainingOpConfig``); the rest - the filter, the input casts emulation under CPU
autocast needs, ``verify()`` and a ``__main__`` that rebuilds the model - is shared.
"""

# how the emitted file configures and converts: torchao's float8 recipes, or its MXFP8 training
FLOAT8 = {"dataclasses": "import dataclasses\n", "imports": """\
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
""", "config": '''
def _emulated(emulate):
    """Emulated where no GPU runs the fp8 GEMMs."""
    return not torch.cuda.is_available() if emulate is None else emulate


def config(emulate=None):
    """The recipe's Float8LinearConfig."""
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(RECIPE), emulate=_emulated(emulate))


def convert(model, emulate=None):
    """``model`` with its Linear layers in fp8, but those in KEEP_IN_BF16 (in place)."""
    emulate = _emulated(emulate)
    model = convert_to_float8_training(model, config=config(emulate), module_filter_fn=module_filter_fn)
    # Float8Linear casts its input to CUDA autocast's dtype, as F.linear would, but follows no
    # CPU autocast: there the emulated high-precision GEMMs would meet bf16 and fp32 operands
    return _hook_inputs(model, _input_cast(_cpu_autocast_dtype)) if emulate else model


def _cpu_autocast_dtype(module):
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None

'''}
MXFP8 = {"dataclasses": "", "imports": """from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.quantization import quantize_
from torchao.quantization.quantize_.common import KernelPreference
""", "config": '''
def _emulated(emulate):
    """Emulated where no GPU has MX tensor cores (compute capability 10.0)."""
    if emulate is not None:
        return emulate
    return not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0))


def config(emulate=None):
    """MXFP8 training: e4m3 in blocks of 32 along each GEMM's reduction dim, E8M0 scales
    rounded down (FLOOR, the OCP MX rule ampaudit measured; torchao's own recipes default to
    RCEIL)."""
    kernels = KernelPreference.EMULATED if _emulated(emulate) else KernelPreference.AUTO
    return MXFP8TrainingOpConfig(kernel_preference=kernels, scale_calculation_mode=ScaleCalculationMode.FLOOR)


def convert(model, emulate=None):
    """``model`` with its Linear layers in MXFP8, but those in KEEP_IN_BF16 (in place). Each
    batch's tokens must be a multiple of 32: the grad-weight GEMM casts along them."""
    emulate = _emulated(emulate)
    quantize_(model, config(emulate), filter_fn=_converts)
    if _drops_bias():
        for fqn, module in model.named_modules():
            if _converts(module, fqn) and module.bias is not None:
                module.register_forward_hook(_add_bias)
    # the emulated MX GEMM dequantizes each operand to its own dtype: under autocast a bf16 input
    # meets the fp32 weight and it fails. bf16 -> fp32 is exact: the same MX blocks
    return _hook_inputs(model, _input_cast(lambda module: module.weight.dtype)) if emulate else model


def _drops_bias():
    """Whether torchao's MXFP8 training computes F.linear(x, weight, bias) as x @ weight.T, without
    the bias (torchao 0.18 does: the bias leaves the forward and gets no gradient). Probed on a
    Linear of zero weight and bias 1, emulated."""
    probe = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with torch.no_grad():
        probe[0].weight.zero_()
        probe[0].bias.fill_(1.0)
    quantize_(probe, config(emulate=True), filter_fn=lambda module, fqn: isinstance(module, torch.nn.Linear))
    with torch.no_grad():
        return bool((probe(torch.ones(32, 32)) == 0).all())


def _add_bias(module, args, output):
    """The bias torchao's MXFP8 GEMM left out, added in high precision as F.linear adds it."""
    return output + module.bias.to(output.dtype)

'''}


TEMPLATE = '''"""fp8 training for this model with torchao, as `ampaudit convert --dtype fp8 --emit torchao`
(ampaudit {version}) measured it on its example inputs: recipe {recipe!r}, {fp8_count} Linear layer(s)
in fp8, {keep_count} kept in bf16 - each named below with the reason.

Use: `convert(model)` before building the optimizer (then train as usual, e.g. under bf16
autocast; torch.compile the model for speed on a GPU). Run this file to {run}:
{steps} AdamW steps of the fp8 model beside bf16 autocast, exit 1 past the tolerance.
"""

import copy
{dataclasses}import math
import sys
from pathlib import Path

import torch
{imports}
RECIPE = {recipe!r}
# Linear layers kept in bf16 (fully qualified names), each with ampaudit's reason:
{keep_block}

def module_filter_fn(module, fqn):
    """torchao's filter: True trains the module in fp8."""
    return fqn not in KEEP_IN_BF16


def _converts(module, fqn):
    return isinstance(module, torch.nn.Linear) and module_filter_fn(module, fqn)


def _input_cast(dtype_of):
    """A forward pre-hook casting a converted Linear's input - ``fc(x)`` or ``fc(input=x)`` - to
    ``dtype_of(module)`` (None: as it is)."""
    def hook(module, args, kwargs):
        dtype = dtype_of(module)
        if dtype is None:
            return None
        if args and isinstance(args[0], torch.Tensor) and args[0].dtype != dtype:
            return (args[0].to(dtype), *args[1:]), kwargs
        x = kwargs.get("input")
        if not args and isinstance(x, torch.Tensor) and x.dtype != dtype:
            return args, {{**kwargs, "input": x.to(dtype)}}
        return None
    return hook


def _hook_inputs(model, hook):
    for fqn, module in model.named_modules():
        if _converts(module, fqn):
            module.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def _copy(model):
    # copy.deepcopy refuses a tensor attribute with autograd history (torch.nn.utils.weight_norm
    # keeps weight so): the copy gets it detached; weight_norm computes it again at each forward
    # (graph/model_copy.py's twin: this file imports torch and torchao only)
    held = [(module, name, value) for module in model.modules() for name, value in vars(module).items()
            if isinstance(value, torch.Tensor) and value.grad_fn is not None]
    try:
        for module, name, value in held:
            module.__dict__[name] = value.detach()
        return copy.deepcopy(model)
    finally:
        for module, name, value in held:
            module.__dict__[name] = value

{config}
STEPS = {steps}
TOLERANCE = {tolerance}


def _first(value):
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if hasattr(value, "loss") and isinstance(value.loss, torch.Tensor):
        return value.loss
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = _first(item)
        if found is not None:
            return found
    return None


def _labelled(model, args, kwargs):
    """Whether the call passes the forward its training targets (``forward(idx, targets)``)."""
    import inspect

    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    return any(name in ("targets", "target", "labels", "label") and value is not None
               for name, value in bound.arguments.items())


def _own_loss(output, labelled):
    """The loss the model computed: ``.loss``, a one-element output, or - given targets - the
    one one-element tensor of a tuple (``(logits, loss)``); None where it computes none."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() and output.numel() == 1 else None
    if labelled and isinstance(output, (tuple, list)):
        scalars = [t for t in output if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() == 1]
        if len(scalars) == 1:
            return scalars[0]
    return None


def _loss(output, target, labelled):
    if target is None:
        return _own_loss(output, labelled).float()
    return torch.nn.functional.mse_loss(_first(output).float(), target)


def _caches(model):
    """The plain dicts and lists the model's modules hold, each with its entries. The copies train
    in eval mode, where a forward may fill one: timm's LeViT caches its attention biases. Kept to
    the next step, those biases would not train, and their graph would be freed in its backward."""
    return [(value, copy.copy(value)) for module in model.modules() for name, value in vars(module).items()
            if type(value) in (dict, list) and name not in ("_parameters", "_buffers", "_modules")]


def _refill(caches):
    for value, entries in caches:
        if isinstance(value, dict):
            value.clear()
            value.update(entries)
        else:
            value[:] = entries


def _train(model, args, kwargs, target, labelled, steps, device):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, caches = [], _caches(model)
    for _ in range(steps):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = _loss(model(*args, **kwargs), target, labelled)
        _refill(caches)
        losses.append(float(loss.detach()))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return losses


def verify(model, args, kwargs=None, steps=STEPS):
    """Train copies of ``model``: one converted to fp8, one in bf16 autocast; compare the loss
    curves over their last quarter (the gap relative to the bf16 curve's area there, or to how
    far training moved the loss when that is larger)."""
    kwargs = kwargs or {{}}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reference = _copy(model).eval()  # eval: no dropout on either side
    caches = _caches(reference)
    with torch.no_grad():
        output = reference(*args, **kwargs)
    _refill(caches)
    first = _first(output)
    target, labelled = None, _labelled(model, args, kwargs)
    if _own_loss(output, labelled) is None:  # no loss of its own: its first output trained to a fixed random target
        generator = torch.Generator().manual_seed(0)
        target = torch.randn(first.shape, generator=generator)
        if first.any():  # else a zero-initialised last layer (DiT's adaLN-Zero): a unit target, as noise prediction's
            target = target * float(first.float().std().clamp_min(1e-3))
    torch.manual_seed(0)
    bf16 = _train(reference, args, kwargs, target, labelled, steps, device)
    fp8_model = convert(_copy(model).eval())
    torch.manual_seed(0)
    fp8 = _train(fp8_model, args, kwargs, target, labelled, steps, device)
    window = max(1, steps // 4)
    tail_ref, tail = bf16[-window:], fp8[-window:]
    if all(math.isfinite(v) for v in tail):
        # relative to the bf16 loss there, or to how far training moved it when that is larger:
        # near zero (an MSE the model fits) rounding noise alone is tens of percent of the loss
        moved = abs(bf16[0] - sum(tail_ref) / window) * window
        gaps = sum(abs(v - r) for r, v in zip(tail_ref, tail, strict=True))
        gap = gaps / max(sum(abs(r) for r in tail_ref), moved, 1e-12)
    else:
        gap = math.inf
    return {{"steps": steps, "bf16": bf16, "fp8": fp8, "worst": gap, "window": window, "tolerance": TOLERANCE,
            "passed": gap <= TOLERANCE}}


MODEL_FILE = {model_file}
MODULE = {module}
ENTRY = {entry}
HF_MODEL = {hf_model}
INPUTS = {inputs}  # the example inputs ampaudit trained on, saved beside this file


def _model():
    """The model as ampaudit built it: from its file, its module or its transformers config."""
    import importlib
    import importlib.util

    if HF_MODEL is not None:
        import transformers

        cls = getattr(transformers, HF_MODEL[0])
        config = cls.config_class.from_dict(HF_MODEL[1])
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        return cls(config)
    if MODULE is not None:
        namespace = vars(importlib.import_module(MODULE))
    else:
        spec = importlib.util.spec_from_file_location("_model", MODEL_FILE)
        module = importlib.util.module_from_spec(spec)
        folder = str(Path(MODEL_FILE).parent)
        sys.path.insert(0, folder)  # the model file's sibling imports, while it imports
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(folder)
        namespace = vars(module)
    torch.manual_seed(0)
    model = eval(ENTRY, namespace)
    return model() if isinstance(model, type) else model


def _inputs():
    saved = torch.load(Path(__file__).with_name(INPUTS), weights_only=True)
    return tuple(saved["args"]), saved["kwargs"]


def main(steps=STEPS):
    """The model rebuilt (seed 0) and verified on the saved inputs: what ampaudit ran."""
    model = _model()
    args, kwargs = _inputs()
    return verify(model, args, kwargs, steps=steps)


if __name__ == "__main__":
    if MODEL_FILE is None and MODULE is None and HF_MODEL is None:
        sys.exit("this policy was made for a model ampaudit cannot rebuild: call verify(model, args, kwargs) yourself")
    if not Path(__file__).with_name(INPUTS).is_file():
        sys.exit(f"{{INPUTS}} is not beside this file (its example inputs could not be saved): "
                 "call verify(model, args, kwargs) yourself")
    result = main()
    print(f"{{RECIPE}}: {{len(KEEP_IN_BF16)}} layer(s) kept in bf16; {{result['steps']}} steps, loss "
          f"{{result['bf16'][-1]:.6g}} (bf16) vs {{result['fp8'][-1]:.6g}} (fp8): gap {{result['worst']:.4g}} "
          f"(tolerance {{TOLERANCE:g}})")
    sys.exit(0 if result["passed"] else 1)
'''
