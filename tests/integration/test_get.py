"""Get on a real farm (redis-server, Celery worker, gRPC gateway, Inductor): a hit is one
ask answered with the entry's bytes as stored and no payload uploaded; a miss takes the
payload on the same stream; a corrupted blob is never served; malformed streams get precise
statuses."""

import dataclasses
import threading

import grpc
import pytest
import torch
import zstandard

import torchfarm
from tests.integration.helpers import TOKENS, direct_request, past_gateway_memory
from torchfarm.client import backend, remote
from torchfarm.contract.cache_key import public_key
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc
from torchfarm.settings import ClientSettings

pytestmark = pytest.mark.integration
ALICE = ClientSettings(token=TOKENS["alice"], progress=False)
METADATA = [("authorization", f"Bearer {TOKENS['alice']}")]


def _ask(request: pb.CompileRequest, **fields) -> pb.Ask:
    return pb.Ask(key=public_key(request.graph, request.target, request.options), **fields)


def _held_get(farm, ask: pb.Ask) -> tuple[list[pb.CompileEvent], list[pb.GetRequest]]:
    """A Get whose request stream sends the ask and then stays open, sending nothing more:
    (the events, every message the gateway read from the stream)."""
    read: list[pb.GetRequest] = []
    answered = threading.Event()

    def requests():
        read.append(pb.GetRequest(ask=ask))
        yield read[-1]
        answered.wait(60)

    with grpc.insecure_channel(farm.addr) as channel:
        try:
            events = list(pb_grpc.FarmStub(channel).Get(requests(), metadata=METADATA, timeout=60))
        finally:
            answered.set()
    return events, read


def test_a_miss_takes_the_payload_on_the_stream_and_a_hit_needs_only_the_ask(farm, store):
    model, x = torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.SiLU()), torch.randn(3, 10)
    request = direct_request(model, x)
    settings = dataclasses.replace(ALICE, addr=farm.addr)
    missed = remote.get(_ask(request), request, settings)
    assert missed.missing is not None and missed.header.source == "miss"
    assert missed.header.encoding == "zstd"
    assert missed.timings["wire_bytes"] == missed.header.stored_size
    events, read = _held_get(farm, _ask(request, label="graph 1"))
    assert [m.WhichOneof("message") for m in read] == ["ask"]  # no payload left the client
    header = events[0].header
    wire = b"".join(e.chunk for e in events[1:])
    entry = store.artifacts.entry(header.key, header.digest)
    assert header.source == "hit" and header.encoding == "zstd"
    assert len(wire) == header.stored_size == entry.stored_bytes < header.size
    assert zstandard.ZstdDecompressor().decompress(wire) == missed.data
    hit = remote.get(_ask(request), request, settings)
    assert hit.missing is None and hit.header.source == "hit" and hit.data == missed.data
    assert hit.timings["wire_bytes"] == entry.stored_bytes


def test_the_backend_hits_with_one_get_and_matches_eager(farm):
    model, x = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU()), torch.randn(4, 16)
    compiled = torchfarm.compile(model, addr=farm.addr, token=TOKENS["alice"])
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
        torch._dynamo.reset()
        compiled = torchfarm.compile(model, addr=farm.addr, token=TOKENS["alice"])
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert [r.source for r in backend.history] in (["miss", "hit"], ["hit", "hit"])
    timings = backend.history[-1].timings
    for name in ("payload_s", "key_s", "rpc_s", "transfer_s", "decompress_s", "verify_s"):
        assert timings[name] >= 0, name
    assert 0 < timings["wire_bytes"] < backend.history[-1].bytes  # compressed on the wire


def test_a_corrupted_blob_is_dropped_and_rebuilt_through_get(farm, store):
    request = direct_request(
        torch.nn.Sequential(torch.nn.Linear(9, 21), torch.nn.Tanh()), torch.randn(3, 9)
    )
    settings = dataclasses.replace(ALICE, addr=farm.addr)
    first = remote.get(_ask(request), request, settings)
    assert remote.get(_ask(request), request, settings).header.source == "hit"  # verified once
    stored = bytearray(store.artifacts.blobs.get(first.header.digest, 1 << 30))  # the store
    stored[len(stored) // 2] ^= 0xFF
    store.artifacts.blobs.put(first.header.digest, bytes(stored))
    compiles = store.counters.farm().get("compiles", 0)
    kept = remote.get(_ask(request), request, settings)  # within the recheck window
    assert kept.header.source == "hit" and kept.data == first.data  # the bytes it verified
    past_gateway_memory()
    again = remote.get(_ask(request), request, settings)
    assert again.missing is not None and again.header.source == "miss"  # never served
    assert store.artifacts.entry(again.header.key, again.header.digest) is not None  # rebuilt
    assert store.counters.farm().get("compiles", 0) == compiles + 1


def _refused(farm, *messages: pb.GetRequest) -> grpc.RpcError:
    with grpc.insecure_channel(farm.addr) as channel, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.FarmStub(channel).Get(iter(messages), metadata=METADATA, timeout=60))
    return e.value


def test_malformed_get_streams_get_precise_statuses(farm):
    key = "0" * 64
    payload = pb.CompileRequest(graph=b"x", target=pb.Target(device="cpu", torch_version="2"))
    cases = [
        ((), "first message is an ask"),
        ((pb.GetRequest(compile=payload),), "first message is an ask"),  # compile before missing
        ((pb.GetRequest(ask=pb.Ask(key=key, sizes=[2] * 100_000)),), "sizes: at most"),
        ((pb.GetRequest(ask=pb.Ask(key=key, sizes=[-4])),), "sizes: at most"),
        ((pb.GetRequest(ask=pb.Ask(key="KEY")),), "key: 64"),
        (
            (pb.GetRequest(ask=pb.Ask(key=key)), pb.GetRequest(ask=pb.Ask(key=key))),
            "after missing, the next message is a compile",
        ),
    ]
    for messages, detail in cases:
        error = _refused(farm, *messages)
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (messages, error)
        assert detail in error.details()
    with grpc.insecure_channel(farm.addr) as channel, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.FarmStub(channel).Get(iter([pb.GetRequest(ask=pb.Ask(key=key))]), timeout=60))
    assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
