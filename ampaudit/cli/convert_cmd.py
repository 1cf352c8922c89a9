"""``ampaudit convert``: its flags; the model converted by ``convert/``, exported, summarized."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ampaudit.cli.common import EXIT_FINDINGS, EXIT_OK, SECONDS, number_type, path_type
from ampaudit.core.dtypes import FP8_RECIPES, LOW_DTYPES
from ampaudit.core.errors import UsageError
from ampaudit.load.time_limit import DEFAULT_SECONDS

_TOLERANCE = number_type(float, least=0, what="a finite relative error >= 0")
_STEPS = number_type(int, least=0, what="a whole number >= 0")


def add_parser(sub: argparse._SubParsersAction) -> None:
    conv = sub.add_parser("convert", help="rewrite a model into explicit mixed precision",
                          description="Convert the model in PATH to fp16/bf16 compute with fp32 where needed, verify "
                                      "it against fp32, and write a standalone module, its weights and plan.json.")
    conv.add_argument("target", metavar="PATH[:NAME]",
                      help="model file (entry points as for `check`), module.path:NAME_OR_EXPR or hf:MODEL_TYPE")
    conv.add_argument("-o", "--output", type=path_type, required=True, metavar="OUT_DIR", help="folder to write to")
    conv.add_argument("--dtype", choices=(*LOW_DTYPES, "fp8"), default="float16",
                      help="fp8: which nn.Linear layers to train in float8 with torchao, measured as `check --dtype "
                           "fp8` does; writes fp8_torchao.py (--emit torchao) and fp8_plan.json")
    conv.add_argument("--fp8-recipe", choices=FP8_RECIPES,
                      help="with --dtype fp8: the recipe (default: of torchao's float8 recipes, the one that keeps the "
                           "fewest layers in bf16; mxfp8 - for GPUs with MX tensor cores - only when asked)")
    conv.add_argument("--no-verify", action="store_true", help="do not compare with fp32 or promote ops")
    conv.add_argument("--tolerance", type=_TOLERANCE,
                      help="relative output error allowed (default 1e-2 fp16, 5e-2 bf16)")
    conv.add_argument("--emit", action="append", default=[], choices=("autocast", "hf", "fsdp2", "torchao"),
                      metavar="FORMAT",
                      help="also write the plan as a policy for other tools: autocast (modules to run in fp32 "
                           "under torch.autocast), hf (_keep_in_fp32_modules), fsdp2 (MixedPrecisionPolicy per "
                           "module); with --dtype fp8: torchao (Float8LinearConfig and module_filter_fn); "
                           "repeatable")
    conv.add_argument("--backend", choices=("auto", "fx", "modules"), default="auto",
                      help="fx: rewrite the traced graph; modules: keep the model's own forward and apply the plan "
                           "per module (any model); auto (default): fx where the model traces, else modules")
    conv.add_argument("--weights", choices=("low", "fp32"), default="low",
                      help="low (default): store low-precision modules' weights low (half their bytes; fp32 masters "
                           "when trained); fp32: keep every weight fp32 and cast it at each use, as autocast does - "
                           "what ampaudit.convert(model, optimizer) does by default (autocast's training memory)")
    conv.add_argument("--train-steps", type=_STEPS, default=20, metavar="N",
                      help="also verify by training: N AdamW steps of copies of the converted and the fp32 model, "
                           "loss by loss (default 20; 0: off)")
    conv.add_argument("--constants", choices=("fp32", "clamp"), default="fp32",
                      help="ops with constants the dtype cannot hold: keep in fp32 (default) or clamp the constant")
    conv.add_argument("--input-shape", action="append", default=[], metavar="SHAPE")
    conv.add_argument("--input-dtype", action="append", default=[], metavar="DTYPE")
    conv.add_argument("--config", action="append", default=[], metavar="KEY=VALUE", dest="model_config",
                      help="for hf:MODEL_TYPE, set a field of the model's config (repeatable)")
    conv.add_argument("--exec", dest="allow_exec", action="store_true")
    conv.add_argument("--import-timeout", type=SECONDS, default=DEFAULT_SECONDS, metavar="SECONDS",
                      help=f"as for check (default {DEFAULT_SECONDS:g}; 0: no limit)")
    conv.add_argument("--force", action="store_true",
                      help="write into a non-empty OUT_DIR that holds no earlier ampaudit export")
    conv.add_argument("--debug", action="store_true", help="show tracebacks for errors")


def _check_fp8_flags(args: argparse.Namespace) -> None:
    fp8 = args.dtype == "fp8"
    if args.fp8_recipe and not fp8:
        raise UsageError("--fp8-recipe goes with --dtype fp8")
    if "torchao" in args.emit and not fp8:
        raise UsageError("--emit torchao writes an fp8 policy: pass --dtype fp8")
    other = [e for e in args.emit if e != "torchao"]
    if fp8 and other:
        raise UsageError(f"--dtype fp8 emits torchao's policy only (not {', '.join(other)})")


def cmd_convert(args: argparse.Namespace) -> int:
    from ampaudit.convert.publish import staged_export
    from ampaudit.core.child import run_in_child
    from ampaudit.core.console import make_console
    from ampaudit.core.findings import Target
    from ampaudit.core.outputs import refuse_special_file, resolve_output
    from ampaudit.core.torch_extra import require_installed
    from ampaudit.load.spec import parse_spec
    from ampaudit.report.conversion import render_conversion

    require_installed("ampaudit convert", ("torch", "safetensors"))  # one line naming the install, exit 2
    _check_fp8_flags(args)
    if not args.target.strip():
        raise UsageError("an empty PATH (an unset variable?): name a model file")
    model_file = parse_spec(args.target).path
    if model_file is not None:
        refuse_special_file(model_file, "the model file")
        model_file = Path(os.path.abspath(model_file))
    # before the model's code runs and before the work: links checked, the path made absolute
    args.output = resolve_output(args.output, "-o", folder=True).path
    job = "fp8_job" if args.dtype == "fp8" else "convert_job"
    with staged_export(args.output, force=args.force, inputs=[model_file] if model_file else []) as staged:
        # the model's code runs in a child process: whatever it does, the parent says it in one line
        done = run_in_child("ampaudit.cli.convert_job", job, args, str(staged.path),
                            str(model_file) if model_file else None, import_timeout=args.import_timeout)
        staged.names, staged.inputs = done.names, done.modules
    files = [args.output / name for name in done.names]
    if args.dtype == "fp8":
        from ampaudit.report.fp8_table import render_fp8_conversion

        render_fp8_conversion(done.summary, done.label, done.entry, [str(f) for f in files], make_console())
        trained = done.summary["train"]
        return EXIT_FINDINGS if trained is not None and not trained["passed"] else EXIT_OK
    render_conversion(done.summary, Target(done.label, done.entry, "fx"), [str(f) for f in files], make_console(),
                      export_ran=done.export_ran)
    after, trained = done.summary["error_after"], done.summary["train"]
    missed = (after is not None and after > done.tolerance) or (trained is not None and not trained["passed"])
    return EXIT_FINDINGS if missed else EXIT_OK
