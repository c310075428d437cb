"""torch.fx._graph_pickler: the pickler behind the payload (what Inductor's compile_fx_ext
uses to ship a graph to another process).

Uses GraphPickler, Options (and its default ops_filter), _ShapeEnvPickleData,
_TensorPickleData and _GraphUnpickler; torch._ops.OpOverload and
torch.fx.Node._pretty_print_target to tell PyTorch's operators from custom ones. Patches
the module global `_GraphUnpickler` while `unpickler_class` is entered: GraphPickler.loads
builds its unpickler from that name.
Verified: torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.fx._graph_pickler as _module
from torch.fx._graph_pickler import GraphPickler, Options
from torch.fx._graph_pickler import _GraphUnpickler as GraphUnpickler
from torch.fx._graph_pickler import _ShapeEnvPickleData as ShapeEnvPickleData
from torch.fx._graph_pickler import _TensorPickleData as TensorPickleData

__all__ = [
    "GraphPickler",
    "GraphUnpickler",
    "Options",
    "ShapeEnvPickleData",
    "TensorPickleData",
    "custom_op_schema",
    "op_schema",
    "unpickler_class",
]

# PyTorch's own operator namespaces (aten, prims, ...): what GraphPickler pickles by default.
_BUILTIN_OPS = Options().ops_filter


def custom_op_schema(target: object) -> str | None:
    """The schema of a custom operator (one outside PyTorch's own namespaces), else None."""
    if (
        isinstance(target, torch._ops.OpOverload)
        and _BUILTIN_OPS is not None
        and not _BUILTIN_OPS(torch.fx.Node._pretty_print_target(target))
    ):
        return op_schema(target)
    return None


def op_schema(target: torch._ops.OpOverload) -> str:
    """An operator's schema as text (how a worker checks it has the client's operator)."""
    return str(target._schema)


@contextlib.contextmanager
def unpickler_class(cls: type[GraphUnpickler]) -> Iterator[None]:
    """Make GraphPickler.loads unpickle with `cls` (a GraphUnpickler subclass)."""
    original = _module._GraphUnpickler
    setattr(_module, "_GraphUnpickler", cls)  # noqa: B010  (a module global, not a type)
    try:
        yield
    finally:
        setattr(_module, "_GraphUnpickler", original)  # noqa: B010
