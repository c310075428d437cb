"""The canonical device index on a real Inductor compile (CPU, in this process, no farm).

A CPU graph names no CUDA device, so normalising the payload changes nothing; loading with
the device rewrite forced on (0 -> 0) goes through the very hooks a cuda:N client uses, on
real artifacts, and must still equal eager.
"""

import torch

from tests.models import build
from torchfarm.compiler import inductor, serialize, trace_state
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.load import device_remap


def _compiled_on_the_worker(model, x):
    """Dynamo's graph of `model`, its real inputs, and the worker's artifact for it."""
    requests = []

    def capture(gm, example_inputs):
        requests.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture)(x)
    ((gm, inputs),) = requests
    options = pb.Options(mode="default", state=trace_state.capture())
    return gm, inputs, inductor.compile_payload(serialize.dumps(gm), options, 1)


def _step(fn, inputs):
    for t in inputs:
        t.grad = None
    (out,) = fn(*inputs)
    out.square().mean().backward()
    return [out.detach(), *[t.grad for t in inputs if t.requires_grad]]


def test_a_cpu_graph_compiles_and_loads_equal_to_eager_through_the_device_rewrite(
    monkeypatch,
):
    gm, inputs, artifact = _compiled_on_the_worker(*build("mlp"))
    assert serialize.local_device_index(gm) is None

    rewritten = []
    remap_graph = device_remap.remap_graph

    def counted(graph, index):
        rewritten.append(list(graph.device_idxs))
        remap_graph(graph, index)

    monkeypatch.setattr(device_remap, "remap_graph", counted)
    monkeypatch.setattr(device_remap, "on_device", lambda index: device_remap.rewriting(0))
    loaded = inductor.load_artifact(artifact, device_index=0)
    eager = _step(gm, inputs)
    got = _step(loaded, inputs)
    assert len(eager) > 2  # the output and the weights' gradients
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a, b)
    assert rewritten == [[], []]  # forward and backward went through the hook, on no device
