"""A static graph's code fetched in the background: what its first call does with the
farm's outcome (no farm here: the outcome is handed to the deferred graph directly)."""

import time

import pytest
import torch
from torch._subclasses.fake_tensor import UnsupportedOperatorException

from torchfarm.client import backend, fetch, graph, remote
from torchfarm.client.deferred import DeferredGraph
from torchfarm.client.graph import FarmGraph
from torchfarm.client.pool import Pool
from torchfarm.compiler import guards
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings


def f(x, w):
    return torch.relu(x @ w) * 2


def _static_graph() -> torch.fx.GraphModule:
    captured = {}

    def capture(gm, example_inputs):
        captured["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    torch.compile(f, backend=capture, dynamic=False)(torch.randn(4, 8), torch.randn(8, 3))
    return captured["gm"]


def _deferred(outcome) -> DeferredGraph:
    """The graph of `f`, its farm work being `outcome` (run on a pool thread)."""
    job = Pool(1).submit(outcome)
    gm = _static_graph()
    farm_graph = FarmGraph(
        gm, [], ClientSettings.from_env(), pb.Options(mode="default"), "graph t", time.monotonic()
    )
    return DeferredGraph(farm_graph, job)


def _farm_down():
    raise remote.FarmError("farm down for this test")


def _artifact_whose_guards_fail():
    return fetch.Fetched(
        pb.Artifact(guards=guards.parse("1 == 2", 0)), pb.ArtifactHeader(source="hit"), {}
    )


@pytest.mark.parametrize(
    ("outcome", "why"),
    [
        (_farm_down, "farm: FarmError: farm down for this test"),
        (_artifact_whose_guards_fail, "shape guards do not hold for these inputs"),
    ],
)
def test_a_graph_the_farm_cannot_serve_compiles_locally_at_its_first_call(outcome, why):
    compiled = _deferred(outcome)
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    before = len(backend.history)
    with pytest.warns(RuntimeWarning, match="compiling locally"):
        (out,) = compiled(x, w)  # a Dynamo graph returns its outputs as a sequence
    torch.testing.assert_close(out, f(x, w))
    [record] = backend.history[before:]
    assert record.source == "local" and why in record.why, record
    assert record.deferred and record.submitted <= record.awaited, record
    # the code is ready: later calls run it, nothing is compiled or recorded again
    torch.testing.assert_close(compiled(2 * x, w)[0], f(2 * x, w))
    assert len(backend.history) == before + 1


def test_a_failing_local_compile_at_the_first_call_runs_eagerly_even_where_dynamo_would_split(
    monkeypatch,
):
    """At compile time Dynamo splits the graph on such an error; at the first call it is too
    late to split, so the graph runs eagerly rather than failing the step."""

    def refuse(*args):
        raise UnsupportedOperatorException(torch.ops.aten.relu.default)

    monkeypatch.setattr(graph, "compile_locally", refuse)
    compiled = _deferred(_farm_down)
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    before = len(backend.history)
    torch.testing.assert_close(compiled(x, w)[0], f(x, w))
    [record] = backend.history[before:]
    assert record.source == "eager" and "UnsupportedOperatorException" in record.why, record
