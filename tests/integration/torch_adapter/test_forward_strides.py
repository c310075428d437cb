"""A compile child sends its backward helper the forward's output strides, with which
AOTAutograd restrides the backward's inputs (torch_adapter/compile/concurrent_backward.py), as
soon as its lowering has decided them: before Inductor generates the forward's code, and
equal to what the backward's compile is given. On the CPU (oneDNN) Inductor's layout
optimization stores a CNN's saved activations channels-last: strides the trace never had."""

from unittest import mock

import torch
from torch._functorch._aot_autograd import graph_compile
from torch._inductor.graph import GraphLowering
from torch._inductor.utils import fresh_cache

from tests.models import build
from torchfarm.compiler import inductor, serialize, trace_state
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.compile import concurrent_backward


def _training_payload(model, x) -> tuple[bytes, pb.Options]:
    """The graph Dynamo gives a backend for a training step, and the state it traced it in."""
    captured = {}

    def backend(gm, example_inputs):
        captured["payload"] = serialize.dumps(gm)
        captured["options"] = pb.Options(state=trace_state.capture())
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x).sum().backward()
    return captured["payload"], captured["options"]


def test_the_forwards_strides_reach_the_helper_once_lowered_and_are_the_backwards():
    payload, options = _training_payload(*build("cnn", seed=5))
    events: list = []
    generate = GraphLowering.compile_to_module
    compile_backward = graph_compile._aot_stage2b_bw_compile

    def generating(self):
        events.append("backward code" if self.is_backward else "forward code")
        return generate(self)

    def backward(bw_module, subclass_meta, fw_metadata, fwd_output_strides, *args, **kwargs):
        events.append(
            ("backward given", [None if s is None else tuple(s) for s in fwd_output_strides])
        )
        return compile_backward(
            bw_module, subclass_meta, fw_metadata, fwd_output_strides, *args, **kwargs
        )

    with (
        fresh_cache(),  # the forward compiled here, not found in the run's cache
        mock.patch.object(GraphLowering, "compile_to_module", generating),
        mock.patch.object(graph_compile, "_aot_stage2b_bw_compile", backward),
        concurrent_backward.backward_from(
            lambda key: events.append("met at the key"), lambda s: events.append(("sent", s))
        ),
    ):
        inductor.compile_payload(payload, options, threads=1)

    order = [e if isinstance(e, str) else e[0] for e in events[:5]]
    assert order == ["sent", "forward code", "backward given", "met at the key", "backward code"]
    (_, sent), (_, given) = events[0], events[2]
    assert sent == given
    assert any(s is not None and len(s) == 4 and s[1] == 1 for s in sent)  # channels-last
