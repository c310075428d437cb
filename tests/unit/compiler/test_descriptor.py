"""The graph's descriptor (key format v4): found again, byte for byte, in the graph the
worker rebuilds from its payload; different wherever the payloads differ; a payload of
another graph refused. (On the zoo's graphs, against the payload's own equality:
bench/payload.py.)"""

import hashlib

import pytest
import torch

from tests.unit.dynamo_graphs import captured
from torchfarm.compiler import descriptor, serialize


class _Views(torch.nn.Module):
    """Views, an in-place op, a cond with two subgraphs, a dtype and a device argument."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x):
        y = self.linear(x).t()[1:]
        y.add_(1)
        z = torch.cond(y.sum() > 0, torch.sin, torch.cos, (y,))
        return z.to(device="cpu", dtype=torch.float64) * 2.5


def _payload_and_descriptor(gm) -> tuple[bytes, bytes]:
    return serialize.dumps(gm), descriptor.describe(gm)


def test_the_worker_finds_the_clients_descriptor_in_the_payload_it_rebuilds():
    for model, x in [
        (torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), torch.randn(3, 8)),
        (_Views(), torch.randn(4, 6)),
    ]:
        (gm,) = captured(model, x)
        payload, described = _payload_and_descriptor(gm)
        rebuilt = descriptor.verified(payload, {}, described)
        assert descriptor.describe(rebuilt) == described
        assert serialize.op_counts(rebuilt) == serialize.op_counts(gm)
        assert [n.name for n in rebuilt.graph.nodes] == [n.name for n in gm.graph.nodes]


def test_graphs_whose_payloads_differ_have_different_descriptors_and_equal_ones_equal():
    x = torch.randn(3, 8)
    cases = {
        "relu": (torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), x),
        "relu again": (torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), x),
        "gelu": (torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()), x),
        "batch 4": (torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), x[:2]),
        "double": (
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).double(),
            x.double(),
        ),
        "strided input": (
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()),
            x.t().contiguous().t(),
        ),
        "input needs grad": (
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()),
            x.clone().requires_grad_(),
        ),
        "views": (_Views(), torch.randn(4, 6)),
        "views again": (_Views(), torch.randn(4, 6)),
    }
    digests = {}
    for name, (model, inputs) in cases.items():
        (gm,) = captured(model, inputs)
        payload, described = _payload_and_descriptor(gm)
        digests[name] = (hashlib.sha256(payload).digest(), hashlib.sha256(described).digest())
    payloads = {p for p, _ in digests.values()}
    assert len(payloads) == len(cases) - 2  # the two repeats
    for a in digests.values():  # one descriptor per payload, and the other way round
        for b in digests.values():
            assert (a[0] == b[0]) == (a[1] == b[1])


def test_a_payload_under_another_graphs_descriptor_is_refused():
    x = torch.randn(3, 8)
    (a,) = captured(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), x)
    (b,) = captured(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sigmoid()), x)
    with pytest.raises(descriptor.Mismatch, match="not the graph its descriptor names"):
        descriptor.verified(serialize.dumps(b), {}, descriptor.describe(a))


def test_a_dynamic_graph_has_no_descriptor_and_its_payload_none_under_a_static_one():
    x = torch.randn(3, 8)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    (dynamic,) = captured(model, x, dynamic=True)
    with pytest.raises(descriptor.Unsupported):
        descriptor.describe(dynamic)
    (static,) = captured(model, x)
    hints = serialize.size_hints(dynamic)
    with pytest.raises(ValueError, match="holds a ShapeEnv"):
        descriptor.verified(serialize.dumps(dynamic), hints, descriptor.describe(static))
