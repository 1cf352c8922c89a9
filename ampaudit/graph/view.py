"""One traced graph plus what every pass over it needs: op kinds, catalog, dtype flow,
and how to name a node's place (file:line:col, module path) in a finding."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import fx

from ampaudit.core.catalog import Catalog, OpPolicy
from ampaudit.core.dtypes import LowDtype
from ampaudit.core.findings import Finding
from ampaudit.core.paths import display_path
from ampaudit.core.rulebook import rule
from ampaudit.graph.declared import Declared, Fp32Module
from ampaudit.graph.dtype_flow import LOW, autocast_flow, low_precision_flow
from ampaudit.graph.fx_tracer import LOC, MODULE
from ampaudit.graph.kinds import node_kind
from ampaudit.graph.python_values import python_values
from ampaudit.graph.trace import SubGraph

STRUCTURAL_OPS = frozenset({"placeholder", "get_attr", "output"})


@dataclass
class GraphView:
    sub: SubGraph
    catalog: Catalog
    dtype: LowDtype
    opaque: frozenset[str] = frozenset()  # modules kept whole because fx failed inside them
    kinds: dict[fx.Node, str] = field(default_factory=dict)
    known: dict[fx.Node, bool] = field(default_factory=dict)
    flow: dict[fx.Node, str | None] = field(default_factory=dict)  # dtype under autocast (dtype_flow)
    low: dict[fx.Node, str | None] = field(default_factory=dict)  # dtype when the model runs in low precision
    python: frozenset[fx.Node] = frozenset()  # nodes computing Python values (sizes), not tensors
    declared: Declared = field(default_factory=Declared)  # what the model declares about its precision
    fp32_declared: dict[fx.Node, Fp32Module] = field(default_factory=dict)  # ops in modules it keeps fp32
    model_wide: bool = True  # the graph that reports findings about the whole model (one per report)

    @classmethod
    def build(cls, sub: SubGraph, catalog: Catalog, dtype: LowDtype, opaque: frozenset[str], *,
              declared: Declared | None = None, model_wide: bool = True) -> GraphView:
        view = cls(sub, catalog, dtype, opaque, declared=declared or Declared(), model_wide=model_wide)
        for node in sub.gm.graph.nodes:
            view.kinds[node], view.known[node] = node_kind(node, sub.gm, catalog)
        view.python = python_values(sub.gm)
        for node in sub.gm.graph.nodes:
            module = view.declared.fp32_module(view.module(node)) if node.op.startswith("call_") else None
            if module is not None and node not in view.python:
                view.fp32_declared[node] = module
        view.flow = autocast_flow(sub.gm, view.kinds, catalog, python=view.python)
        view.low = low_precision_flow(sub.gm, view.kinds, catalog, python=view.python, fp32=view.fp32_declared)
        return view

    def kind(self, value: Any) -> str | None:
        return self.kinds.get(value) if isinstance(value, fx.Node) else None

    def runs_low(self, node: fx.Node) -> bool:
        """Whether the node computes in fp16/bf16 unless the code itself upcasts it."""
        return self.low.get(node) == LOW

    @property
    def nodes(self) -> list[fx.Node]:
        return list(self.sub.gm.graph.nodes)

    def ops(self) -> list[fx.Node]:
        """Nodes that compute something: not inputs, attributes, outputs, opaque modules or
        Python arithmetic on sizes."""
        return [n for n in self.sub.gm.graph.nodes
                if n.op not in STRUCTURAL_OPS and not self.is_opaque(n) and n not in self.python]

    def is_opaque(self, node: fx.Node) -> bool:
        return node.op == "call_module" and self.module(node) in self.opaque

    def policy(self, node: fx.Node) -> OpPolicy | None:
        return self.catalog.lookup(self.kinds[node])

    def module(self, node: fx.Node) -> str | None:
        path = node.meta.get(MODULE)
        prefix = self.sub.prefix
        if not prefix:
            return path
        return f"{prefix}.{path}" if path else prefix

    def name(self, node: fx.Node) -> str:
        return f"{self.sub.prefix}:{node.name}" if self.sub.prefix else node.name

    def finding(self, code: str, node: fx.Node, *, fix: str | None = None, **fields: Any) -> Finding:
        loc = node.meta[LOC]
        return rule(code).finding(display_path(loc.file), loc.line, column=loc.column, module=self.module(node),
                                  node=self.name(node), fix=fix, **fields)
