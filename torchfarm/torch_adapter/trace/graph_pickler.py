"""torch.fx._graph_pickler: the pickler behind the payload (what Inductor's compile_fx_ext
uses to ship a graph to another process).

Uses GraphPickler, Options (and its default ops_filter), _ShapeEnvPickleData,
_TensorPickleData, _GraphModulePickleData (its `graph`, a _GraphPickleData, and that one's
`nodes`, one _NodePickleData per node in the graph's order, each with `args` and `kwargs`)
and _GraphUnpickler; torch._ops.OpOverload and torch.fx.Node._pretty_print_target to tell
PyTorch's operators from custom ones. Patches the module global `_GraphUnpickler` while
`unpickler_class` is entered: GraphPickler.loads builds its unpickler from that name.
Registers `slice` as a pytree node (torch.utils._pytree's private register/deregister) while
`GraphPickler.loads` runs.
Verified: torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator

import torch
import torch.fx._graph_pickler as _module
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._graph_pickler import GraphPickler as _TorchGraphPickler
from torch.fx._graph_pickler import Options, _GraphModulePickleData
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


class GraphPickler(_TorchGraphPickler):
    """torch's GraphPickler without its pytree patch: torch 2.13+ registers `slice` as a
    pytree node while `dumps` runs (its node data maps arguments with pytree), and Dynamo
    guards on that registry (`len(SUPPORTED_NODES)`), so pickling beside Dynamo on another
    thread failed a guard on the frame that built it. Here a node's arguments are mapped
    with torch.fx's `map_arg`, which walks slices itself: the same bytes, and on torch 2.11
    (no patch) a slice holding a node pickles too. `loads` keeps the registration, where
    nothing traces beside it (a worker's child)."""

    @classmethod
    def dumps(cls, obj: object, options: Options | None = None) -> bytes:
        with io.BytesIO() as stream:
            cls(stream, options).dump(obj)
            return stream.getvalue()

    def reducer_override(self, obj: object):
        if isinstance(obj, torch.fx.GraphModule):
            data = _GraphModulePickleData(obj, self.options)
            nodes = dict(zip(obj.graph.nodes, data.graph.nodes, strict=True))
            for node, pickled in nodes.items():  # pytree left a slice's nodes in it
                pickled.args = torch.fx.node.map_arg(node.args, nodes.__getitem__)
                pickled.kwargs = torch.fx.node.map_arg(node.kwargs, nodes.__getitem__)
            return _GraphModulePickleData.unpickle, (data, self._unpickle_state)
        return super().reducer_override(obj)

    @staticmethod
    def loads(data: bytes, fake_mode: FakeTensorMode) -> object:
        """torch's, with `slice` a pytree node throughout (torch 2.13+ registers it there
        itself; 2.11 would leave a node's data in a slice)."""
        with _slices_as_pytree_nodes():
            return _TorchGraphPickler.loads(data, fake_mode)


@contextlib.contextmanager
def _slices_as_pytree_nodes() -> Iterator[None]:
    """What torch 2.13+'s `patch_pytree_map_over_slice` does, for torch 2.11 too: process-wide
    state, never where Dynamo traces on another thread."""
    if slice in pytree.SUPPORTED_NODES:
        yield
        return
    pytree._private_register_pytree_node(
        slice, lambda s: ([s.start, s.stop, s.step], None), lambda fields, _: slice(*fields)
    )
    try:
        yield
    finally:
        pytree._deregister_pytree_node(slice)


@contextlib.contextmanager
def unpickler_class(cls: type[GraphUnpickler]) -> Iterator[None]:
    """Make GraphPickler.loads unpickle with `cls` (a GraphUnpickler subclass)."""
    original = _module._GraphUnpickler
    setattr(_module, "_GraphUnpickler", cls)  # noqa: B010  (a module global, not a type)
    try:
        yield
    finally:
        setattr(_module, "_GraphUnpickler", original)  # noqa: B010
