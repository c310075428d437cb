"""Whether a Dynamo graph may be compiled after the backend has returned.

Two things must happen while Dynamo still compiles the frame: installing the farm's shape
guards into Dynamo's ShapeEnv (any graph with a symbol: a dynamic size, or an unbacked one
from a data-dependent op), and handing Dynamo a fake-tensor error on which it splits the
graph, which a local compile raises for ops whose fake or backward tracing reads values (seen
with custom operators). A static graph of torch's own operators needs neither, so it can be
fetched while Dynamo goes on. Uses torch.fx.experimental.symbolic_shapes.free_symbols,
node.meta["example_value"], torch._ops.OpOverload.namespace and
OpOverloadPacket._qualified_op_name.
Verified: torch 2.11.0, 2.13.0.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import free_symbols
from torch.utils import _pytree as pytree

__all__ = ["deferrable"]

_VALUES = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)
_TORCH_NAMESPACES = frozenset({"aten", "prims"})


def deferrable(gm: torch.fx.GraphModule) -> bool:
    """True if `gm` is static and calls no custom operator."""
    return _static(gm) and not any(_custom_op(node.target) for node in gm.graph.nodes)


def _static(gm: torch.fx.GraphModule) -> bool:
    """No input, intermediate or output carries a symbol. A computing node without an example
    value counts as symbolic (what cannot be seen is not promised static), unless nothing
    reads it: a call made for its effect (grad mode, API-usage logging) carries no value."""
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if "example_value" not in node.meta and node.op != "get_attr" and node.users:
            return False
        for leaf in pytree.tree_leaves(node.meta.get("example_value")):
            if isinstance(leaf, _VALUES) and free_symbols(leaf):
                return False
    return True


def _custom_op(target: object) -> bool:
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace not in _TORCH_NAMESPACES
    if isinstance(target, torch._ops.OpOverloadPacket):  # "namespace::name"
        return target._qualified_op_name.split("::")[0] not in _TORCH_NAMESPACES
    return False
