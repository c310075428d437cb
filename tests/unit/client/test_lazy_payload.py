"""A static graph is asked for by its descriptor: its payload is made only on a miss, never
on Dynamo's thread for the ask, never on a hit (issue 52: it cost 0.05-0.6 s a hit)."""

import functools
import hashlib

import torch
import zstandard

from tests.unit.dynamo_graphs import captured
from torchfarm.client import remote
from torchfarm.client.graph import FarmGraph
from torchfarm.compiler import serialize
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings

ARTIFACT = b"an artifact"


def _static_graph() -> torch.fx.GraphModule:
    (gm,) = captured(lambda x: x[1:, ::2].sin() * 2, torch.randn(4, 6), dynamic=None)
    return gm


class _HittingStub:
    """A farm whose Hit call answers with the artifact; it has no Get (a hit needs none)."""

    def Hit(self, ask, timeout, metadata):  # noqa: N802  (gRPC's name)
        header = pb.ArtifactHeader(
            digest=hashlib.sha256(ARTIFACT).hexdigest(), size=len(ARTIFACT), encoding="zstd"
        )
        return pb.HitReply(header=header, data=zstandard.compress(ARTIFACT))


def test_a_hit_makes_no_payload(monkeypatch):
    gm = _static_graph()
    payload = serialize.dumps(gm)
    made = []

    def dumps(graph):
        made.append(graph)
        return payload

    monkeypatch.setattr(serialize, "dumps", dumps)
    settings = ClientSettings(addr="farm.invalid:1", progress=False)
    graph = FarmGraph(gm, [], settings, pb.Options(mode="default"), "graph 0")
    question = graph.ask()
    assert question.request.descriptor and question.request.graph == b""
    assert made == [] and graph.timings["payload_s"] >= 0
    completed = functools.partial(remote._completed, question.request, question.payload)
    received = remote._get_once(
        _HittingStub(), question.ask, completed, settings, remote.Listeners()
    )
    assert received.data == ARTIFACT and made == []
    # A miss: the request the farm reads after `missing` carries the payload, made then.
    assert completed().graph == payload
    assert made == [gm] and "miss_payload_s" in graph.timings
