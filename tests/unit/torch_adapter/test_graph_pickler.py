"""The payload's pickler never writes pytree's registry, which Dynamo guards on (a write
from a pool thread failed a guard on another frame: 'Guard failed on the same frame it was
created'), and its bytes are torch's own GraphPickler's where that one pickles at all."""

import pytest
import torch
import torch.utils._pytree as pytree

from tests.unit.dynamo_graphs import captured
from torchfarm.compiler import serialize
from torchfarm.torch_adapter.trace import graph_pickler


class _Watched(dict):
    """pytree's registry, recording every write."""

    writes: list

    def __setitem__(self, key, value):
        self.writes.append(("set", key))
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.writes.append(("del", key))
        super().__delitem__(key)

    def pop(self, key, *default):
        self.writes.append(("pop", key))
        return super().pop(key, *default)


def _sliced(x):
    """A slice holding a node (the dynamic size) and one of constants."""
    return x[:, : x.shape[0] - 1] * 2 + x[1:3, ::2].sum()


def _graph() -> torch.fx.GraphModule:
    x = torch.randn(6, 8)
    torch._dynamo.mark_dynamic(x, 0)
    (gm,) = captured(_sliced, x, dynamic=None)
    return gm


def _node_slices(gm: torch.fx.GraphModule) -> list[slice]:
    return [
        s
        for node in gm.graph.nodes
        for arg in node.args
        if isinstance(arg, tuple)
        for s in arg
        if isinstance(s, slice) and isinstance(s.stop, torch.fx.Node)
    ]


def test_dumps_leaves_pytree_registry_alone_and_round_trips(monkeypatch):
    gm = _graph()
    assert _node_slices(gm), "the graph needs a slice holding a node"
    watched = _Watched(pytree.SUPPORTED_NODES)
    watched.writes = []
    monkeypatch.setattr(pytree, "SUPPORTED_NODES", watched)
    payload = serialize.dumps(gm)
    assert watched.writes == []
    monkeypatch.undo()
    loaded = serialize.loads(payload, serialize.size_hints(gm))
    assert loaded.code == gm.code
    assert [s.stop.name for s in _node_slices(loaded)] == [s.stop.name for s in _node_slices(gm)]
    assert slice not in pytree.SUPPORTED_NODES


def test_same_bytes_as_torchs_pickler(monkeypatch):
    if not hasattr(torch.fx._graph_pickler, "patch_pytree_map_over_slice"):
        pytest.skip("torch 2.11's pickler refuses a slice holding a node (a raw Node)")
    gm = _graph()
    payload = serialize.dumps(gm)
    torchs = graph_pickler._TorchGraphPickler
    monkeypatch.setattr(graph_pickler.GraphPickler, "reducer_override", torchs.reducer_override)
    monkeypatch.setattr(graph_pickler.GraphPickler, "dumps", torchs.__dict__["dumps"])
    assert serialize.dumps(gm) == payload
