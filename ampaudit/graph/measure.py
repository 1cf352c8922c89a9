"""Run the range probe on the example inputs; a failing op becomes a one-line LoadError."""

from __future__ import annotations

from torch import fx

from ampaudit.core.catalog import Catalog
from ampaudit.core.dtypes import LowDtype
from ampaudit.core.errors import LoadError
from ampaudit.core.paths import display_path
from ampaudit.core.tensors import has_tensor
from ampaudit.graph.forward import ExampleInputs
from ampaudit.graph.fx_tracer import LOC
from ampaudit.graph.kinds import node_kind
from ampaudit.graph.range_probe import ProbeError, probe


def measure_ranges(gm: fx.GraphModule, inputs: ExampleInputs, catalog: Catalog, dtype: LowDtype) -> None:
    kinds = {n: node_kind(n, gm, catalog)[0] for n in gm.graph.nodes}
    try:
        output = probe(gm, dtype, kinds, inputs.args, inputs.kwargs, catalog)
    except ProbeError as exc:
        loc = exc.node.meta[LOC]
        text = str(exc.error).strip().splitlines()[0] if str(exc.error).strip() else ""
        raise LoadError(f"the example inputs ({inputs.origin}) fail to run the model: "
                        f"{type(exc.error).__name__}: {text} ({display_path(loc.file)}:{loc.line})") from exc.error
    except TypeError as exc:  # the inputs do not match forward's signature
        raise LoadError(f"the example inputs ({inputs.origin}) fail to run the model: TypeError: {exc}") from exc
    if not has_tensor(output):
        raise LoadError(f"the model's output holds no tensor (got {type(output).__name__}): "
                        "ampaudit audits models whose forward returns tensors")
