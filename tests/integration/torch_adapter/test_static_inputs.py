"""The inputs Dynamo marks static on the client (the module's parameters) are static in the
worker's compile too (torch_adapter/trace/static_inputs.py): Inductor then assumes their alignment
instead of checking it at every call, as a local compile does."""

from unittest import mock

import torch
from torch._inductor import compile_fx

from torchfarm.compiler import inductor, serialize
from torchfarm.proto import torchfarm_pb2 as pb


def _payload(model, x) -> bytes:
    captured = {}

    def backend(gm, example_inputs):
        captured["payload"] = serialize.dumps(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x)
    return captured["payload"]


def _static_input_idxs_inductor_sees(payload: bytes) -> list[list[int]]:
    seen = []
    check = compile_fx.get_input_idxs_to_check

    def recording(inputs, static_input_idxs):
        seen.append(sorted(static_input_idxs))
        return check(inputs, static_input_idxs)

    with mock.patch.object(compile_fx, "get_input_idxs_to_check", recording):
        inductor.compile_payload(payload, pb.Options(), threads=1)
    return seen


def test_the_modules_parameters_travel_as_static_inputs_and_inductor_sees_them():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    payload = _payload(model, torch.randn(3, 8))
    gm = serialize.loads(payload)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    static = serialize.static_inputs(gm)
    assert len(names) == 5 and static == [i for i, n in enumerate(names) if "parameters" in n]
    with torch.no_grad():  # an inference graph: one compile, its inputs the graph's own
        seen = _static_input_idxs_inductor_sees(payload)
    assert seen == [static]


def test_a_graph_of_plain_inputs_has_none_static():
    payload = _payload(lambda a: (a @ a.T).relu(), torch.randn(4, 4))
    assert serialize.static_inputs(serialize.loads(payload)) == []
