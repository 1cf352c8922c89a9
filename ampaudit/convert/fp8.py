"""``convert --dtype fp8 --emit torchao`` and ``ampaudit.fp8_policy``: which Linears to train in
fp8 with which torchao recipe, measured on the model (``graph/fp8_verdicts.py``), written as a
standalone Python file - the ``Float8LinearConfig`` (or, for mxfp8, ``MXFP8TrainingOpConfig``)
and a ``module_filter_fn`` naming exactly the layers kept in bf16, each with its reason - and
verified by training.

The verification is the emitted file's own ``main()``: ampaudit loads the file it wrote and runs
it - the model rebuilt as the file rebuilds it (``ModelSource``), the example inputs loaded from
``fp8_inputs.pt`` beside it - so running the file as written gives the same numbers. It trains k
steps of a copy converted with torchao (emulated without a GPU that has the kernels) beside k
steps of a copy under bf16 autocast, AdamW on the example inputs, and compares the loss curves
by applied update over their last quarter, as the fp16/bf16 training check does
(convert/train_check.py).
"""

from __future__ import annotations

import importlib.util
import io
import json
import pprint
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ampaudit._version import __version__
from ampaudit.convert.fp8_emitted import FLOAT8, MXFP8, TEMPLATE
from ampaudit.convert.publish import FP8_FILES, seal_staging
from ampaudit.core.arguments import require_module
from ampaudit.core.errors import LoadError, UsageError
from ampaudit.core.import_noise import quiet_imports
from ampaudit.core.listing import listed
from ampaudit.graph.forward import ExampleInputs
from ampaudit.graph.fp8_casts import EMITTED_RECIPES, TORCHAO_RECIPES
from ampaudit.graph.fp8_measure import float8_linears
from ampaudit.graph.fp8_verdicts import Fp8Judgement, judge, layer_verdicts, mx_tokens_problem

EMIT_FILE, PLAN_FILE, INPUTS_FILE = FP8_FILES
DEFAULT_STEPS = 20
TOLERANCE = 5e-2  # relative gap of the curves' ends, fp8 against bf16 autocast (bf16's own against fp32)


@dataclass
class Fp8Policy:
    """The recipe, the Linears kept in bf16 (FQN -> why) and those that train in fp8."""

    recipe: str
    keep: dict[str, str]
    fp8: list[str]
    table: dict[str, Any] = field(default_factory=dict)  # the measurements (check's Report.fp8)

    def module_filter_fn(self, module: torch.nn.Module, fqn: str) -> bool:
        """torchao's filter: True converts the module to fp8 - ``convert_to_float8_training``'s
        ``module_filter_fn``, or ``quantize_``'s ``filter_fn`` for MXFP8, which asks of every
        module (an Embedding's weight must stay as it is)."""
        return isinstance(module, torch.nn.Linear) and fqn not in self.keep

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "keep": dict(self.keep), "fp8": list(self.fp8)}


def policy_from(judgement: Fp8Judgement) -> Fp8Policy:
    keep = {v.layer.name: "; ".join(f"{x.code}: {x.reason}" for x in v.verdicts) for v in judgement.layers if v.keep}
    fp8 = [v.layer.name for v in judgement.layers if not v.keep]
    return Fp8Policy(judgement.recipe, keep, fp8, judgement.to_dict())


def choose_recipe(model: torch.nn.Module, inputs: ExampleInputs) -> str:
    """The torchao recipe that keeps the fewest layers in bf16 (per-layer verdicts, one
    measurement); ties go to the cheaper one: tensorwise, then rowwise."""
    judgement = judge(model, inputs, "tensorwise")
    kept = {r: sum(bool(layer_verdicts(v.layer, r)) for v in judgement.layers) for r in TORCHAO_RECIPES}
    return min(TORCHAO_RECIPES, key=lambda r: (kept[r], TORCHAO_RECIPES.index(r)))


def fp8_policy(model: torch.nn.Module, example_inputs: Any, *, recipe: str | None = None) -> Fp8Policy:
    """Which of ``model``'s Linears train in fp8 and which stay in bf16, and why, measured on
    ``example_inputs`` (one fp32 forward and backward). ``recipe``: tensorwise, rowwise,
    rowwise_with_gw_hp (torchao's float8 recipes) or mxfp8 (its MXFP8 training); None picks the
    float8 recipe that keeps the fewest."""
    require_module(model, "ampaudit.fp8_policy", eager=True)
    inputs = ExampleInputs.coerce(example_inputs, "example_inputs")
    if recipe is not None and recipe not in EMITTED_RECIPES:
        raise UsageError(f"the fp8 recipes are {', '.join(EMITTED_RECIPES)} (got {recipe!r})")
    recipe = recipe or choose_recipe(model, inputs)
    judgement = judge(model, inputs, recipe)
    if not judgement.layers:  # a policy of no layers converts nothing: the export would be a no-op
        raise LoadError("no nn.Linear ran on the example inputs: nothing for fp8 training to convert "
                        "(torchao's float8 training converts nn.Linear layers)")
    return policy_from(judgement)


@dataclass(frozen=True)
class ModelSource:
    """How the emitted file rebuilds the model ampaudit measured: from its file (``path``), an
    importable module (``module``) or a transformers config (``hf``: the model class's name and
    its config as a dict), then ``entry`` evaluated there; all None: it cannot."""

    path: str | None = None
    module: str | None = None
    entry: str | None = None
    hf: tuple[str, dict[str, Any]] | None = None

    @classmethod
    def of_hf(cls, model: torch.nn.Module) -> ModelSource:
        fields = {k: v for k, v in model.config.to_diff_dict().items() if k != "transformers_version"}
        return cls(hf=(type(model).__name__, fields))


def emit_torchao(policy: Fp8Policy, source: ModelSource = ModelSource(), *, steps: int = DEFAULT_STEPS,
                 tolerance: float = TOLERANCE) -> str:
    """The standalone file: config, filter, ``convert(model)``, ``verify()`` and a ``__main__``
    that rebuilds the model as ampaudit built it, loads the inputs saved beside it
    (``write_fp8``) and verifies."""
    keep_lines = "".join(f"    {fqn!r},  # {_comment(reason)}\n" for fqn, reason in policy.keep.items())
    keep_block = f"KEEP_IN_BF16 = {{\n{keep_lines}}}\n" if policy.keep else "KEEP_IN_BF16: set[str] = set()\n"
    return TEMPLATE.format(**(MXFP8 if policy.recipe == "mxfp8" else FLOAT8), version=__version__,
                            recipe=policy.recipe, keep_block=keep_block,
                            fp8_count=len(policy.fp8), keep_count=len(policy.keep), steps=steps or DEFAULT_STEPS,
                            run="repeat ampaudit's verification" if steps else
                            "verify it (ampaudit wrote it untrained, --train-steps 0)",
                            tolerance=repr(tolerance), model_file=repr(source.path), module=repr(source.module),
                            entry=repr(source.entry), hf_model=pprint.pformat(source.hf, width=100, sort_dicts=True),
                            inputs=repr(INPUTS_FILE))


def _comment(reason: str) -> str:
    return " ".join(reason.split()).replace("\\", "/")


def load_emitted(path: Path) -> Any:
    """The emitted file as a module (ampaudit's verification runs its ``verify``)."""
    spec = importlib.util.spec_from_file_location(f"_ampaudit_fp8_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    with quiet_imports():
        spec.loader.exec_module(module)
    return module


def saved_inputs(inputs: ExampleInputs) -> bytes | None:
    """``inputs`` as the file the emitted module loads (``torch.load(..., weights_only=True)``),
    or None where they hold what that cannot load (an object of the user's own class)."""
    detached = {"args": [_detached(v) for v in inputs.args],
                "kwargs": {k: _detached(v) for k, v in inputs.kwargs.items()}}
    buffer = io.BytesIO()
    torch.save(detached, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception:  # whatever the restricted unpickler refuses
        return None
    return buffer.getvalue()


def _detached(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def write_fp8(folder: Path, policy: Fp8Policy, text: str, verification: dict[str, Any] | None,
              shown: Path | None = None, inputs: bytes | None = None) -> list[str]:
    """The emitted file, the plan (policy, measurements, verification) and the example inputs
    (``saved_inputs``) into ``folder`` (a staging folder: ``shown``, the folder it becomes, is
    what errors name)."""
    from ampaudit.convert.publish import MANIFEST, call_reported
    from ampaudit.core.files import write_atomic

    shown = shown if shown is not None else folder
    names = [EMIT_FILE, PLAN_FILE]
    write_atomic(folder / EMIT_FILE, text, shown=str(shown / EMIT_FILE))
    if inputs is not None:
        write_atomic(folder / INPUTS_FILE, inputs, shown=str(shown / INPUTS_FILE))
        names.append(INPUTS_FILE)
    plan = {"tool": "ampaudit", "version": __version__, **policy.to_dict(), "train": verification,
            "layers": policy.table.get("layers", [])}
    write_atomic(folder / PLAN_FILE, json.dumps(plan, indent=2, default=str) + "\n", shown=str(shown / PLAN_FILE))
    # a manifest, as every export has: without it the next export into the folder (or --force into
    # one holding the user's files) took it for the user's files
    call_reported(f"cannot write {shown / MANIFEST}", lambda: seal_staging(folder, names, uuid.uuid4().hex))
    return names


# what the emitted file imports, by recipe: torchao's float8 training, or its MXFP8 training (torchao 0.18 on)
_TORCHAO_MODULE = {"mxfp8": "torchao.prototype.moe_training.config"}


def require_torchao(recipe: str | None = None) -> None:
    """Verifying trains with torchao (the emitted file imports it): one line when it is
    missing, or too old for ``recipe``'s training."""
    name = _TORCHAO_MODULE.get(recipe or "", "torchao.float8")
    try:
        with quiet_imports():
            __import__(name)  # as the emitted file's import statement does: the package first
    except ImportError:
        raise UsageError(f"verifying an fp8 policy trains with torchao ({name}, which does not import here): "
                         'pip install -U "ampaudit[fp8]" (or pass --train-steps 0)') from None


def require_unconverted(model: torch.nn.Module) -> None:
    """A model converted to float8 already cannot be verified against bf16 (its 'bf16' copy
    trains in fp8 too) and the emitted file would convert it again: one line, nothing written."""
    done = float8_linears(model)
    if done:
        names = listed([f"`{n}`" for n in done], 3)
        raise UsageError(f"the model is converted to float8 already (torchao's Float8Linear: {names}): give "
                         "convert the model before convert_to_float8_training")


def require_trainable(policy: Fp8Policy) -> None:
    """MXFP8 training casts the grad-weight GEMM's operands in blocks of 32 along the tokens:
    torchao asserts that every fp8 Linear's tokens per batch are a multiple of 32. One line
    before training, where the example batch has others."""
    if policy.recipe != "mxfp8":
        return
    problem = mx_tokens_problem({layer["name"]: layer["rows"] for layer in policy.table.get("layers", [])
                                 if layer["name"] in policy.fp8})
    if problem:
        raise UsageError(f"{problem}: give example inputs of such a shape, or --train-steps 0 to write the policy "
                         "without training it")


def verify_with(module: Any, model: torch.nn.Module, inputs: ExampleInputs, steps: int) -> dict[str, Any]:
    """The emitted file's ``verify`` on ``model`` (copies are trained; it is untouched)."""
    return module.verify(model, inputs.args, inputs.kwargs, steps=steps)
