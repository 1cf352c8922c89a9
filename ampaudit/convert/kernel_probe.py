"""Ops with no kernel for the low dtype on the model's device (``torch.fft.*`` in float16 on
a CPU, some ops in bfloat16 on older GPUs): found by running the converted model once on
the example inputs, and kept in fp32 with a plan entry saying why.

The run goes through an fx Interpreter per converted graph, so a failure names its node -
the innermost graph's - without parsing tracebacks. A node that still fails in fp32, or
fails with anything but a RuntimeError, is not a kernel problem: that error is raised.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx

from ampaudit.convert.plan import FP32, Decision
from ampaudit.core.errors import LoadError
from ampaudit.core.kept_attributes import attributes_kept
from ampaudit.graph.forward import ExampleInputs, describe_exception
from ampaudit.graph.range_probe import placeholder_values

MAX_PROBES = 16  # ops promoted one at a time; more than this is not a missing kernel


class _Locating(fx.Interpreter):
    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        return super().run_node(n)


def failing_node(model: torch.nn.Module, inputs: ExampleInputs) -> tuple[str, BaseException] | None:
    """Run ``model`` once; if an op in one of its fx graphs raises, that op's plan name
    (``prefix:node``) and the error; None when the model runs."""
    failed: list[tuple[str, BaseException]] = []
    graphs = [(path, m) for path, m in model.named_modules() if isinstance(m, fx.GraphModule)]

    def locating(path: str, gm: fx.GraphModule) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            interpreter = _Locating(gm)
            try:
                return interpreter.run(*placeholder_values(gm, args, kwargs), enable_io_processing=False)
            except Exception as exc:
                if not failed:  # the innermost graph records first
                    node = interpreter.current.name
                    failed.append((f"{path}:{node}" if path else node, exc))
                raise
        return forward

    for path, gm in graphs:
        gm.forward = locating(path, gm)  # an instance attribute: the class's forward is untouched
    try:
        with torch.no_grad(), attributes_kept(model):
            model(*inputs.args, **inputs.kwargs)
    except Exception as exc:
        return failed[0] if failed else ("", exc)
    finally:
        for _, gm in graphs:
            del gm.forward
    return None


def promote_missing_kernels(build: Callable[[Mapping[str, Decision]], torch.nn.Module], inputs: ExampleInputs,
                            dtype: str) -> tuple[torch.nn.Module, dict[str, Decision]]:
    """Build, run, and move each op that fails in ``dtype`` to fp32 until the model runs.
    Returns the model and the ops moved (node -> its fp32 decision)."""
    moved: dict[str, Decision] = {}
    model = build(moved)
    for _ in range(MAX_PROBES):
        failure = failing_node(model, inputs)
        if failure is None:
            return model, moved
        node, error = failure
        if not node:  # in the code of a module fx could not trace, kept as written around converted children
            raise LoadError(f"the converted model fails to run in a module torch.fx could not trace: "
                            f"{describe_exception(error)} (its own code reads its converted children - a fused "
                            "fast path reading their weights, say; --backend modules converts it)") from error
        # fails in fp32 too, or not the RuntimeError a missing kernel raises (a TypeError is a
        # bug, ours or the model's): not a kernel
        if node in moved or not isinstance(error, RuntimeError):
            raise LoadError(f"the converted model fails to run: {describe_exception(error)}") from error
        moved[node] = Decision(FP32, f"no {dtype} kernel for this op on {_device(model)} "
                                     f"({describe_exception(error)}): kept in fp32", "kernel")
        model = build(moved)
    raise LoadError(f"the converted model still fails after moving {MAX_PROBES} ops to fp32")


def _device(model: torch.nn.Module) -> str:
    first = next(model.parameters(), None)
    return first.device.type if first is not None else "cpu"


def low_sites_without_kernel(build: Callable[[Mapping[str, Decision]], torch.nn.Module], inputs: ExampleInputs,
                             dtype: str) -> tuple[torch.nn.Module, dict[str, Decision]]:
    """The modules backend's ops that it casts down itself (no autocast lowers them:
    ``torch._grouped_mm``): build, run, and move the sites whose low call raised to fp32 until
    the model runs or fails elsewhere (that error is verification's to report). Returns the
    model and the ops moved (node -> its fp32 decision)."""
    moved: dict[str, Decision] = {}
    model = build(moved)
    for _ in range(MAX_PROBES):
        ops = getattr(model, "ampaudit_fp32_ops", None)
        if ops is None or not ops.low_sites:
            break
        ops.failed.clear()
        error: BaseException | None = None
        try:
            with torch.no_grad(), attributes_kept(model):
                model(*inputs.args, **inputs.kwargs)
        except RuntimeError as exc:
            error = exc
        failed, ops.failed = set(ops.failed), set()
        new = {str(r["node"]): Decision(FP32, f"no {dtype} kernel for this op on {_device(model)} "
                                              f"({describe_exception(error)}): kept in fp32", "kernel")
               for r in model.plan if (r.get("kind"), os.path.basename(str(r.get("file"))), r.get("line")) in failed
               and str(r["node"]) not in moved}
        if error is None or not new:
            break
        moved.update(new)
        model = build(moved)
    return model, moved
