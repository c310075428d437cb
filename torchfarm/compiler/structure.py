"""A graph's structure digest: which program a graph belongs to, for explaining misses.

Two traces of one program at other shapes, dtypes, constants, devices, options or torch
builds give other payloads (other keys) but the same structure: the operators called, in order,
and how their results feed each other. The client computes it for Ask.key_parts and the
worker's compile child for the entry it stores (Artifact.structure), from the same graph, so
the gateway can find a miss's nearest entry among those of the same program.
"""

from __future__ import annotations

import hashlib

import torch

from torchfarm.torch_adapter.trace.operators import is_operator

_FORMAT = b"torchfarm-structure-v1"


def _target(node: torch.fx.Node) -> str:
    """What the node does; input and attribute names are left out (a renamed module is the
    same program)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return node.op
    target = node.target
    if isinstance(target, str):  # call_method, call_module
        return f"{node.op}:{target}"
    if is_operator(target):
        return f"{node.op}:{target}"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", "?")
    return f"{node.op}:{module}.{name}"


def digest(gm: torch.fx.GraphModule) -> str:
    """sha256 of the graph's operators and data flow (each node's target, the nodes it reads,
    its arity and keyword names), without shapes, dtypes or constants. On the client it runs
    for every graph, hits included, so it only reads what FX keeps at hand."""
    numbers: dict[torch.fx.Node, int] = {}
    lines = []
    for number, node in enumerate(gm.graph.nodes):
        numbers[node] = number
        reads = ",".join(str(numbers[n]) for n in node.all_input_nodes)
        lines.append(f"{_target(node)}|{reads}|{len(node.args)}|{','.join(node.kwargs)}")
    return hashlib.sha256(_FORMAT + "\n".join(lines).encode()).hexdigest()
