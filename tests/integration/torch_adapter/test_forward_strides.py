"""A compile child sends its backward helper the forward's output strides, with which
AOTAutograd restrides the backward's inputs (torch_adapter/compile/concurrent_backward.py), as
soon as its lowering has decided them: before Inductor generates the forward's code, and
equal to what the backward's compile is given. On the CPU (oneDNN) Inductor's layout
optimization stores a CNN's saved activations channels-last: strides the trace never had."""

from unittest import mock

import pytest
import torch
from torch._functorch._aot_autograd import graph_compile
from torch._inductor.graph import GraphLowering

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


def test_the_forwards_strides_reach_the_helper_once_lowered_and_are_the_backwards(caches):
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
        caches(),  # the forward compiled here, not found in the run's cache
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


def _childs(payload: bytes, options: pb.Options, caches) -> tuple[list, concurrent_backward.Key]:
    """The strides the child sends and its backward's key."""
    sent, keys = [], []
    with (
        caches(),
        concurrent_backward.backward_from(keys.append, sent.append),
    ):
        inductor.compile_payload(payload, options, threads=1)
    return sent[0], keys[0]


@pytest.mark.parametrize(
    "name, order",
    [("transformer", ["lowered", "key", "code"]), ("cnn", ["lowered", "key", "lowered", "code"])],
)
def test_the_helper_lowers_its_backward_at_once_and_again_only_where_the_childs_strides_differ(
    name, order, caches
):
    """The helper lowers the backward for the traced strides before the child's arrive, and
    hands its key on only once they hold it: the transformer's saved activations keep their
    traced strides; the CNN's the child stores channels-last (oneDNN), so its backward is
    lowered again with them (that key handed on at once). Either way it is the child's."""
    payload, options = _training_payload(*build(name, seed=5))
    strides, childs_key = _childs(payload, options, caches)
    events: list = []
    run, generate = GraphLowering.run, GraphLowering.compile_to_module

    def lowering(self, *args):
        events.append("lowered")
        return run(self, *args)

    def generating(self):
        events.append("code")
        return generate(self)

    with (
        caches(),  # compiled, not found in the child's cache
        mock.patch.object(GraphLowering, "run", lowering),
        mock.patch.object(GraphLowering, "compile_to_module", generating),
        concurrent_backward.backward_only(lambda: strides, events.append),
        pytest.raises(concurrent_backward.Stopped),
    ):
        inductor.compile_payload(payload, options, threads=1)

    keys = [e for e in events if isinstance(e, concurrent_backward.Key)]
    assert [e if isinstance(e, str) else "key" for e in events] == order
    assert keys[0].key == childs_key.key


@pytest.mark.parametrize("name, first_lowering", [("transformer", "whole"), ("cnn", "cut")])
def test_strides_that_arrive_during_the_lowering_cut_it_where_they_restride(
    name, first_lowering, caches
):
    """Strides the child sent while the helper lowers are checked at the lowering's next node:
    the CNN's restride, so its first lowering stops at its first node instead of running to
    its end for nothing (its backward is lowered again with them); the transformer's hold,
    so its lowering goes on. Either way the key handed on is the child's."""
    payload, options = _training_payload(*build(name, seed=5))
    strides, childs_key = _childs(payload, options, caches)
    nodes: list[int] = []  # per lowering: the nodes it ran
    run, run_node = GraphLowering.run, GraphLowering.run_node

    def lowering(self, *args):
        nodes.append(0)
        return run(self, *args)

    def running(self, node):
        nodes[-1] += 1
        return run_node(self, node)

    keys: list = []
    with (
        caches(),
        mock.patch.object(GraphLowering, "run", lowering),
        mock.patch.object(GraphLowering, "run_node", running),
        concurrent_backward.backward_only(
            lambda: strides, keys.append, strides_arrived=lambda: True
        ),
        pytest.raises(concurrent_backward.Stopped),
    ):
        inductor.compile_payload(payload, options, threads=1)

    assert [k.key for k in keys] == [childs_key.key]
    if first_lowering == "cut":
        assert len(nodes) == 2 and nodes[0] == 0 and nodes[1] > 0
    else:
        assert len(nodes) == 1 and nodes[0] > 0
