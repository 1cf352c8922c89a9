"""Checkpointed calls stay checkpointed in a converted graph.

Traced, ``torch.utils.checkpoint.checkpoint(block, x)`` leaves only its function's ops in the
graph: the converted model would keep every activation the user chose to recompute. The tracer
marks the nodes each checkpoint call's function made (graph/fx_tracer.py); after the plan's casts
are in, each marked part moves into a graph of its own, called from the outer graph under
checkpoint with the call's own options (``use_reentrant``, ``preserve_rng_state``, ...). The
ops inside keep their plan and casts - the part is cut out of the converted graph, not converted
apart - and the state stays where it was: the part reads its owner's parameters and modules.
"""

from __future__ import annotations

import operator
import warnings

from torch import fx
from torch.fx.graph_module import _format_import_block
from torch.package import sys_importer

from ampaudit.convert.runtime import CheckpointedCall, cast, checkpointed
from ampaudit.graph.fx_tracer import Checkpoint, checkpoint_of

_OUTSIDE = ("placeholder", "get_attr", "output")
PREFIX = "ampaudit_checkpoint_"


def keep_checkpoints(gm: fx.GraphModule) -> int:
    """Move each checkpointed part of ``gm``'s graph into a ``CheckpointedCall``; how many."""
    parts = _parts(gm.graph)
    for index, (checkpoint, nodes) in enumerate(parts.items()):
        _outline(gm, f"{PREFIX}{index}", checkpoint, nodes)
    if parts:
        for node in reversed(gm.graph.nodes):
            if node.op == "get_attr" and not node.users:
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
    return len(parts)


def _parts(graph: fx.Graph) -> dict[Checkpoint, list[fx.Node]]:
    """The nodes of each checkpoint call, in graph order. A cast the rewrite inserted belongs to
    the part whose value it casts, or whose ops alone read it (a weight cast at its use is
    recomputed in backward, as under autocast)."""
    member: dict[fx.Node, Checkpoint] = {}
    for node in graph.nodes:
        if node.op not in _OUTSIDE and (found := checkpoint_of(node)) is not None:
            member[node] = found
    for node in graph.nodes:
        if node.target is cast and (source := node.args[0]) in member:
            member[node] = member[source]
    for node in reversed(graph.nodes):
        if node.target is cast and node not in member:
            owners = {member.get(user) for user in node.users}
            if len(owners) == 1 and None not in owners:
                member[node] = owners.pop()
    parts: dict[Checkpoint, list[fx.Node]] = {}
    for node in graph.nodes:
        if node in member:
            parts.setdefault(member[node], []).append(node)
    return parts


def _outline(gm: fx.GraphModule, name: str, checkpoint: Checkpoint, nodes: list[fx.Node]) -> None:
    inside = set(nodes)
    inputs: list[fx.Node] = []  # values from outside, in the order the part first reads them
    for node in nodes:
        for value in node.all_input_nodes:
            if value not in inside and value.op != "get_attr" and value not in inputs:
                inputs.append(value)
    outputs = [node for node in nodes if any(user not in inside for user in node.users)]
    part = fx.Graph()
    env: dict[fx.Node, fx.Node] = {value: part.placeholder(value.name) for value in inputs}
    for node in nodes:
        for value in node.all_input_nodes:
            if value.op == "get_attr" and value not in env:
                env[value] = part.get_attr(value.target)
        env[node] = part.node_copy(node, lambda value: env[value])
    part.output(tuple(env[node] for node in outputs))
    code = fx.GraphModule(gm, part, f"{type(gm).__name__}Checkpointed")
    # what a pickle keeps of the part: its code after the imports of what it calls (GraphModule's own way)
    source = _format_import_block(code.recompile().globals, sys_importer) + code.code
    setattr(gm, name, CheckpointedCall(gm, type(code).forward, dict(checkpoint.kwargs), code.code, source))

    graph = gm.graph
    with graph.inserting_after(nodes[-1]), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fx asks for a module or tensor: this is neither, on purpose
        owner = graph.get_attr(name)
    with graph.inserting_after(owner):
        call = graph.call_function(checkpointed, (owner, *inputs))
    after = call
    for index, node in enumerate(outputs):
        with graph.inserting_after(after):
            after = graph.call_function(operator.getitem, (call, index))
        after.meta.update(node.meta)
        node.replace_all_uses_with(after, delete_user_cb=lambda user: user not in inside)
    for node in reversed(nodes):
        graph.erase_node(node)
