"""What ``ampaudit convert`` does in its child process (core/child.py): load the model - the
user's code runs here - convert it, verify it against fp32, train copies of both, and write the
export into the staging folder the parent made. The parent checks OUT_DIR before, publishes the
staged files after, and renders the summary this returns."""

from __future__ import annotations

import argparse
import contextlib
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ampaudit.core.errors import USER_CODE_ERRORS, UsageError


@dataclass
class Converted:
    """What crosses back to the parent: plain data, so that it never imports torch."""

    summary: dict[str, Any]
    label: str
    entry: str
    names: list[str]  # the files staged (convert/export.py), the manifest not counted
    modules: list[str]  # every module file the model imported: the export may overwrite none
    tolerance: float
    export_ran: bool  # the staged export was loaded back and ran on the example inputs (False: there are none)


def convert_job(args: argparse.Namespace, staging: str, model_file: str | None) -> Converted:
    from ampaudit.core.torch_extra import require_torch

    require_torch("ampaudit convert", ("torch", "safetensors"))  # one line naming the install, exit 2
    import torch

    from ampaudit.convert.api import DEFAULT_TOLERANCE, convert
    from ampaudit.convert.export import stage
    from ampaudit.convert.low_weights import fp32_inputs, low_weight_dtypes
    from ampaudit.convert.train_check import CLI_SECONDS, train_check
    from ampaudit.core.console import slow_status
    from ampaudit.core.dtypes import LowDtype
    from ampaudit.load.loader import NotImported, load_target

    loaded = load_target(args.target, allow_exec=args.allow_exec, input_shapes=args.input_shape,
                         input_dtypes=args.input_dtype, model_config=args.model_config, import_timeout=None)
    if isinstance(loaded, NotImported):
        raise UsageError(f"{loaded.path} was not imported: {loaded.what} at line {loaded.line} would run on "
                         "import (pass --exec to import it anyway)")
    if loaded.inputs is not None and low_weight_dtypes(loaded.model):  # inputs as the fp32 copy takes them
        loaded.inputs = fp32_inputs(loaded.inputs)
    # no trainable parameter, nothing to train: the conversion is still checked against fp32
    trains = args.train_steps > 0 and loaded.inputs is not None and not args.no_verify \
        and any(p.requires_grad for p in loaded.model.parameters())
    progress = slow_status("converting: tracing, deciding, verifying against fp32"
                           + (f", {args.train_steps} training steps" if trains else ""))
    with progress:
        model_mp = convert(loaded.model, loaded.inputs, dtype=args.dtype, verify=not args.no_verify,
                           constants=args.constants, tolerance=args.tolerance, backend=args.backend,
                           weights=args.weights)
        if trains:  # AdamW, the usual optimizer; the check trains copies, within the CLI's time budget
            optimizer = torch.optim.AdamW(loaded.model.parameters(), lr=1e-3)
            model_mp.summary.train = train_check(loaded.model, model_mp, optimizer, loaded.inputs,
                                                 dtype=LowDtype.parse(args.dtype), steps=args.train_steps,
                                                 budget=CLI_SECONDS).to_dict()
    # what the loader said (the default inputs failed to run the model, a torch.compile'd model's
    # wrapped module, spectral_norm iterated): check shows these notes, and convert dropped them
    model_mp.summary.notes[:0] = loaded.notes
    summary = model_mp.summary.to_dict()
    names = stage(model_mp, Path(staging), args.output, summary=summary, emit=dict.fromkeys(args.emit))
    if loaded.inputs is not None:
        run_export(loaded.model, Path(staging), loaded.inputs, args.output)
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE[args.dtype]
    return Converted(summary, loaded.label, loaded.entry, names, list(_model_files(model_file)), tolerance,
                     export_ran=loaded.inputs is not None)


def fp8_job(args: argparse.Namespace, staging: str, model_file: str | None) -> Converted:
    """``convert --dtype fp8``: the policy measured, the torchao file written and run by the
    verification (its own ``main()``, the model rebuilt from its file as running it does)."""
    from ampaudit.core.torch_extra import require_torch

    require_torch("ampaudit convert", ("torch",))
    from ampaudit.convert.fp8 import (
        TOLERANCE,
        ModelSource,
        emit_torchao,
        fp8_policy,
        load_emitted,
        require_torchao,
        require_trainable,
        require_unconverted,
        saved_inputs,
        verify_with,
        write_fp8,
    )
    from ampaudit.core.console import slow_status
    from ampaudit.graph.fp8_other_gemms import other_gemms, other_gemms_note, unrun_linears, unrun_linears_note
    from ampaudit.graph.fp8_verdicts import zero_grad_note
    from ampaudit.load.loader import NotImported, load_target

    loaded = load_target(args.target, allow_exec=args.allow_exec, input_shapes=args.input_shape,
                         input_dtypes=args.input_dtype, model_config=args.model_config, import_timeout=None)
    if isinstance(loaded, NotImported):
        raise UsageError(f"{loaded.path} was not imported: {loaded.what} at line {loaded.line} would run on "
                         "import (pass --exec to import it anyway)")
    if loaded.inputs is None:
        raise UsageError("an fp8 policy is measured on the model's example inputs: define example_inputs() or "
                         "give --input-shape" + "".join(f" ({note})" for note in loaded.notes))
    require_unconverted(loaded.model)
    steps = args.train_steps
    tolerance = args.tolerance if args.tolerance is not None else TOLERANCE
    with slow_status("measuring every nn.Linear in fp8" + (f", {steps} training steps" if steps else "")):
        policy = fp8_policy(loaded.model, loaded.inputs, recipe=args.fp8_recipe)
        source = _source(args.target, loaded)
        text = emit_torchao(policy, source, steps=steps, tolerance=tolerance)
        inputs = saved_inputs(loaded.inputs)
        names = write_fp8(Path(staging), policy, text, None, shown=args.output, inputs=inputs)
        train = None
        if steps and not args.no_verify:
            require_torchao(policy.recipe)
            require_trainable(policy)
            module = load_emitted(Path(staging) / names[0])
            # what running the file does, where it can: rebuild the model, load the saved inputs
            rebuilt = inputs is not None and source != ModelSource()
            with _fp8_training_failure(args.output, policy.recipe):
                train = module.main(steps=steps) if rebuilt else \
                    verify_with(module, loaded.model, loaded.inputs, steps)
            write_fp8(Path(staging), policy, text, train, shown=args.output, inputs=inputs)
    other = other_gemms_note(other_gemms(loaded.model))  # GPT-2's Conv1D projections: why "0 nn.Linear"
    zero = [layer["name"] for layer in policy.table.get("layers", []) if layer.get("grad_all_zero")]
    unrun = unrun_linears_note(unrun_linears(loaded.model, [layer["name"] for layer in policy.table.get("layers", [])]))
    notes = [*loaded.notes, *([zero_grad_note(zero)] if zero else []), *[note for note in (other, unrun) if note]]
    summary = {"dtype": "fp8", **policy.to_dict(), "table": policy.table, "train": train, "notes": notes}
    return Converted(summary, loaded.label, loaded.entry, names, list(_model_files(model_file)), tolerance,
                     export_ran=False)


@contextlib.contextmanager
def _fp8_training_failure(output: Path, recipe: str) -> Iterator[None]:
    """Training the converted model raised (Falcon writes into a Linear's output in place, which
    torchao's Float8Linear returns as a view autograd refuses to modify): the policy does not
    train this model as written - exit 1, one line naming the error and where, nothing written.
    Under a recipe other than tensorwise, torchao's own gaps are among the causes (rowwise: "aten.clone
    with axiswise scaling is not supported yet" for a Linear on a transposed input, timm's LeViT):
    the line names the recipe that runs the most models."""
    from ampaudit.core.errors import AmpauditError, VerificationFailed

    try:
        yield
    except (AmpauditError, *USER_CODE_ERRORS) as exc:
        other = "another recipe may train it: --fp8-recipe tensorwise; " if recipe != "tensorwise" else ""
        raise VerificationFailed(f"training the model in fp8 with torchao ({recipe}) failed: {_raised_at(exc)}; "
                                 f"nothing was written to {output} ({other}--train-steps 0 writes the policy "
                                 "untrained)") from exc


def _raised_at(exc: BaseException) -> str:
    """``Type: first line (file:line)``, the line in the user's code where it can be found."""
    from ampaudit.core.paths import display_path
    from ampaudit.core.userframe import traceback_location

    where = traceback_location(exc.__traceback__)
    at = f" ({display_path(where.file)}:{where.line})" if where is not None else ""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}{at}"


def _source(target: str, loaded: Any) -> Any:
    """How the emitted fp8 file rebuilds the model: its file, its module or its transformers config."""
    from ampaudit.convert.fp8 import ModelSource
    from ampaudit.load.spec import parse_spec

    if loaded.path is not None:
        return ModelSource(path=str(loaded.path.resolve()), entry=loaded.entry)
    spec = parse_spec(target)
    if spec.kind == "hf":
        return ModelSource.of_hf(loaded.model)
    return ModelSource(module=spec.module, entry=loaded.entry)


def run_export(model: Any, staging: Path, inputs: Any, output: Path) -> None:
    """Load the staged export back as a user would (``ampaudit.apply`` on a model built as
    this one was) and run its forward on the example inputs: one that raises is never
    published (VerificationFailed: exit 1, one line naming the error and the user's line)."""
    import torch

    from ampaudit.convert.apply import apply
    from ampaudit.core.errors import AmpauditError, VerificationFailed

    try:
        applied = apply(model, staging)
        with torch.no_grad():
            applied(*inputs.args, **inputs.kwargs)
    except (AmpauditError, *USER_CODE_ERRORS) as exc:
        raise VerificationFailed(f"the export fails on its example inputs, loaded back with ampaudit.apply: "
                                 f"{_raised_at(exc)}; nothing was written to {output}") from exc


def _model_files(model_file: str | None) -> Iterator[str]:
    """The model file and every module file loaded so far - a sibling ``module.py`` the model
    imported among them."""
    if model_file:
        yield model_file
    for module in list(sys.modules.values()):
        # vars(), not getattr: a module's __getattr__ (lazy imports) must not run here
        file = vars(module).get("__file__") if isinstance(module, types.ModuleType) else None
        if isinstance(file, str):
            yield file
