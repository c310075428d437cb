"""Whether a Dynamo graph is static: no symbol in any of its example values.

A graph with a symbol (a dynamic size, or an unbacked one from a data-dependent op) may need
the farm's shape guards installed into Dynamo's ShapeEnv, or a split by Dynamo, before the
backend returns; a static one can be compiled after it has returned, while Dynamo goes on.
Uses torch.fx.experimental.symbolic_shapes.free_symbols and node.meta["example_value"].
Verified: torch 2.11.0, 2.13.0.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import free_symbols
from torch.utils import _pytree as pytree

__all__ = ["is_static"]

_VALUES = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)


def is_static(gm: torch.fx.GraphModule) -> bool:
    """True if no input, intermediate or output of `gm` carries a symbol. A computing node
    without an example value counts as symbolic: what cannot be seen is not promised static."""
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if "example_value" not in node.meta and node.op != "get_attr":
            return False
        for leaf in pytree.tree_leaves(node.meta.get("example_value")):
            if isinstance(leaf, _VALUES) and free_symbols(leaf):
                return False
    return True
