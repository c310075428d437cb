"""The canary's request: a graph the worker traces itself, serialized as a client's is."""

import torch

from torchfarm.compiler import serialize
from torchfarm.workers import canary


def test_the_canary_is_a_tiny_static_graph_serialized_as_a_client_does():
    graph, hints = canary.canary_request("cpu")
    assert hints == {}  # static: nothing to hint
    assert graph == canary.canary_request("cpu")[0]  # deterministic, as cache keys need
    gm = serialize.loads(graph, hints)  # trusted here: the test built it
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.relu in targets or torch.ops.aten.relu.default in targets
    assert serialize.op_counts(gm)  # ops a compile child has something to do with
    (x,) = serialize.example_inputs(gm)
    assert tuple(x.shape) == (4, 8) and x.device.type == "cpu"


def test_a_gpu_pools_canary_is_traced_without_touching_the_gpu():
    graph, _ = canary.canary_request("cuda")  # this machine has none
    (x,) = serialize.example_inputs(serialize.loads(graph))
    assert x.device.type == "cuda"
