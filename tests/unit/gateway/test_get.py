"""Get's hit path against a bare redis-server: the coordinator picks the entry (guards on the
asked sizes, the tenant's visibility, a named digest) and never serves a corrupted blob; the
servicer answers in one round trip with the bytes as stored, and refuses malformed streams
precisely."""

import os
import threading
import time

import grpc
import pytest
import zstandard

from tests.unit.gateway.conftest import TARGET
from torchfarm.cache import keys
from torchfarm.cache.artifacts import VerifiedBlobs, digest_of
from torchfarm.cache.store import Store
from torchfarm.client import remote
from torchfarm.contract.cache_key import cache_key, private_key
from torchfarm.gateway import auth, server
from torchfarm.gateway.coordinator import Coordinator
from torchfarm.gateway.server import build_server
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc
from torchfarm.settings import ClientSettings, GatewaySettings

KEY = cache_key(b"graph payload", TARGET, pb.Options())
TOKEN = "alice-token-0123456789"
METADATA = [("authorization", f"Bearer {TOKEN}")]


def _relation(op, constant: int) -> pb.GuardExpr:
    return pb.GuardExpr(
        apply=pb.GuardApply(op=op, args=[pb.GuardExpr(input=0), pb.GuardExpr(constant=constant)])
    )


SMALL = pb.ShapeGuards(all=[_relation(pb.GuardApply.LE, 8)])  # t0 <= 8
LARGE = pb.ShapeGuards(all=[_relation(pb.GuardApply.GT, 8)])  # t0 > 8


def _put(store: Store, data: bytes, key: str = KEY, created: float = 0.0, **meta) -> pb.EntryMeta:
    return store.artifacts.put(key, data, pb.EntryMeta(created=created, **meta))


def _get(coordinator: Coordinator, tenant: str = "alice", **ask):
    return coordinator.get(pb.Ask(key=KEY, **ask), tenant, "rid")


def _decoded(stored: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(stored)


def test_the_guards_choose_the_entry_on_the_asked_sizes_newest_first(store):
    coordinator = Coordinator(store, enqueue=None, compile_timeout_s=60)
    _put(store, b"small", guards=SMALL, tenant="alice", created=1.0)
    _put(store, b"large", guards=LARGE, tenant="alice", created=2.0)
    _put(store, b"small, newer", guards=SMALL, tenant="bob", created=3.0)
    assert _decoded(_get(coordinator, sizes=[4]).stored) == b"small, newer"
    served = _get(coordinator, sizes=[64])
    assert served.source == "hit" and _decoded(served.stored) == b"large"
    assert served.key == KEY and served.entry.size == len(b"large")
    assert _get(coordinator, sizes=[]) is None  # guards over t0 hold on no sizes at all
    coordinator.hits.flush()
    assert store.counters.farm()["hits"] == 2


def test_a_private_entry_is_its_tenants_alone_and_public_ones_are_everyones(store):
    coordinator = Coordinator(store, enqueue=None, compile_timeout_s=60)
    _put(store, b"alice's own", key=private_key(KEY, "alice"), tenant="alice", private=True)
    _put(store, b"alice's, public", tenant="alice")
    mine = _get(coordinator, private=True)
    assert mine.key == private_key(KEY, "alice") and _decoded(mine.stored) == b"alice's own"
    assert _get(coordinator, tenant="bob", private=True) is None
    assert _decoded(_get(coordinator, tenant="bob").stored) == b"alice's, public"
    # a private entry stored (by a worker) under the public key is still not bob's
    store.artifacts.drop(KEY)
    _put(store, b"alice's", tenant="alice", private=True)
    assert _get(coordinator, tenant="bob") is None and _get(coordinator) is not None


def test_a_digest_names_exactly_that_entry_or_nothing(store):
    coordinator = Coordinator(store, enqueue=None, compile_timeout_s=60)
    old = _put(store, b"old", guards=SMALL, created=1.0)
    _put(store, b"new", guards=SMALL, created=2.0)
    assert _decoded(_get(coordinator, digest=old.digest, sizes=[4]).stored) == b"old"
    assert _get(coordinator, digest=digest_of(b"never stored")) is None


def test_a_corrupted_blob_is_dropped_and_never_served_even_once_verified(store):
    store.artifacts.verified = VerifiedBlobs(1 << 20)
    coordinator = Coordinator(store, enqueue=None, compile_timeout_s=60)
    older = _put(store, b"older, intact" * 50, created=1.0)
    newer = _put(store, b"newer, to be corrupted" * 50, created=2.0)
    assert _get(coordinator).entry.digest == newer.digest  # verified once, remembered
    stored = bytearray(store.artifacts.redis.get(keys.blob(newer.digest)))
    stored[len(stored) // 2] ^= 0xFF
    store.artifacts.redis.set(keys.blob(newer.digest), bytes(stored))
    assert _get(coordinator).entry.digest == older.digest  # the next one that holds
    assert [e.digest for e in store.artifacts.entries(KEY)] == [older.digest]
    assert store.artifacts.redis.get(keys.blob(newer.digest)) is None


def test_a_verified_blob_is_served_from_memory_until_its_recheck_then_found_corrupt(store):
    store.artifacts.verified = VerifiedBlobs(1 << 20, recheck_s=0.3)
    coordinator = Coordinator(store, enqueue=None, compile_timeout_s=60)
    older = _put(store, b"older, intact" * 50, created=1.0)
    newer = _put(store, b"newer, to be corrupted" * 50, created=2.0)
    served = _get(coordinator)
    assert served.entry.digest == newer.digest
    stored = bytearray(store.artifacts.redis.get(keys.blob(newer.digest)))
    stored[len(stored) // 2] ^= 0xFF
    store.artifacts.redis.set(keys.blob(newer.digest), bytes(stored))
    kept = _get(coordinator)  # within the recheck: the verified bytes, the store not read
    assert kept.entry.digest == newer.digest and kept.stored == served.stored != bytes(stored)
    time.sleep(0.35)
    assert _get(coordinator).entry.digest == older.digest  # compared again: dropped
    assert [e.digest for e in store.artifacts.entries(KEY)] == [older.digest]
    store.artifacts.drop(KEY)  # a drop forgets the blobs it kept: nothing served from memory
    assert _get(coordinator) is None


def test_the_verified_blobs_are_bounded_and_least_recently_used_go_first():
    memo = VerifiedBlobs(max_bytes=10)
    memo.remember("a", b"aaaa")
    memo.remember("b", b"bbbb")
    assert memo.holds("a", b"aaaa")  # a is now the most recently used
    memo.remember("c", b"cccc")
    assert memo.holds("a", b"aaaa") and memo.holds("c", b"cccc") and not memo.holds("b", b"bbbb")
    assert not memo.holds("a", b"aaab")  # the same digest, other bytes: not verified
    memo.remember("big", b"x" * 11)
    assert not memo.holds("big", b"x" * 11)
    assert not VerifiedBlobs().holds("a", b"aaaa") and VerifiedBlobs()._bytes == 0


# ---- the servicer ---------------------------------------------------------------------


@pytest.fixture
def gateway(redis_url, store):
    settings = GatewaySettings(
        port=0,
        redis_url=redis_url,
        tenants=f"alice:{auth.hash_token(TOKEN)}",
        metrics_port=0,
        chunk_bytes=1024,
    )
    server, port = build_server(settings, store)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


class Stream:
    """A Get request stream the test drives: it sends what it is given, records it, and
    (`hold`) stays open, as a client's does until it is answered."""

    def __init__(self, *messages: pb.GetRequest, hold: bool = False):
        self.outbox = list(messages)
        self.sent: list[pb.GetRequest] = []
        self.hold = hold
        self.more = threading.Event()

    def __iter__(self):
        for message in self.outbox:
            self.sent.append(message)
            yield message
        if self.hold:
            self.more.wait(20)


def _events(addr: str, stream: Stream) -> list[pb.CompileEvent]:
    with grpc.insecure_channel(addr) as channel:
        try:
            return list(pb_grpc.FarmStub(channel).Get(iter(stream), metadata=METADATA, timeout=20))
        finally:
            stream.more.set()


def test_a_hit_is_one_ask_answered_with_the_stored_bytes_in_chunks(gateway, store):
    artifact = os.urandom(4000) + bytes(50_000)  # stored in more than one 1 KiB chunk
    entry = _put(store, artifact, guards=LARGE)
    # the stream stays open: the answer comes from the ask alone
    stream = Stream(pb.GetRequest(ask=pb.Ask(key=KEY, sizes=[9], label="graph 1")), hold=True)
    events = _events(gateway, stream)
    header = events[0].header
    chunks = [e.chunk for e in events[1:]]
    assert [e.WhichOneof("event") for e in events[1:]] == ["chunk"] * len(chunks)
    assert len(chunks) > 1 and [len(c) for c in chunks[:-1]] == [1024] * (len(chunks) - 1)
    wire = b"".join(chunks)
    assert header.encoding == "zstd" and header.source == "hit"
    assert header.stored_size == len(wire) == entry.stored_bytes < entry.size
    assert header.digest == entry.digest and header.size == len(artifact)
    assert _decoded(wire) == artifact
    assert [m.WhichOneof("message") for m in stream.sent] == ["ask"]  # no payload was sent


def test_a_miss_says_missing_then_takes_the_payload_on_the_same_stream(gateway, store):
    _put(store, b"small", guards=SMALL)
    ask = pb.GetRequest(ask=pb.Ask(key=KEY, sizes=[9]))
    compile_request = pb.GetRequest(compile=pb.CompileRequest(graph=b"", target=TARGET))
    with pytest.raises(grpc.RpcError) as e:
        _events(gateway, Stream(ask, compile_request))
    # the payload was read and validated as Compile validates it
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "empty graph payload" in e.value.details()
    # a client that goes on without the farm just ends the stream after `missing`
    events = _events(gateway, Stream(ask))
    assert [ev.WhichOneof("event") for ev in events] == ["missing"]


@pytest.mark.parametrize(
    "messages,detail",
    [
        ([], "first message is an ask"),
        ([pb.GetRequest(compile=pb.CompileRequest(graph=b"x", target=TARGET))], "is an ask"),
        ([pb.GetRequest(ask=pb.Ask(key="0" * 63))], "key: 64"),
        ([pb.GetRequest(ask=pb.Ask(key=KEY, digest="xyz"))], "digest"),
        ([pb.GetRequest(ask=pb.Ask(key=KEY, sizes=[3, -1]))], "sizes"),
        ([pb.GetRequest(ask=pb.Ask(key=KEY, sizes=[1] * 5000))], "sizes"),
        ([pb.GetRequest(ask=pb.Ask(key=KEY, key_parts={"graph": "g" * 65}))], "key_parts"),
        ([pb.GetRequest(ask=pb.Ask(key=KEY, key_parts={str(i): "" for i in range(65)}))], "key"),
        (
            [pb.GetRequest(ask=pb.Ask(key=KEY)), pb.GetRequest(ask=pb.Ask(key=KEY))],
            "after missing, the next message is a compile",
        ),
    ],
)
def test_a_malformed_stream_gets_invalid_argument_with_what_is_wrong(gateway, messages, detail):
    with pytest.raises(grpc.RpcError) as e:
        _events(gateway, Stream(*messages))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert detail in e.value.details()


def test_bytes_that_are_no_get_request_get_invalid_argument(gateway):
    with grpc.insecure_channel(gateway) as channel:
        call = channel.stream_stream("/torchfarm.v1.Farm/Get")(
            iter([b"\xff\xff\xff"]), metadata=METADATA, timeout=20
        )
        with pytest.raises(grpc.RpcError) as e:
            list(call)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid" in e.value.details()


def test_get_needs_a_token(gateway):
    with grpc.insecure_channel(gateway) as channel, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.FarmStub(channel).Get(iter([pb.GetRequest(ask=pb.Ask(key=KEY))]), timeout=20))
    assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED


def _hit(addr: str, ask: pb.Ask, metadata=METADATA) -> pb.HitReply:
    with grpc.insecure_channel(addr) as channel:
        return pb_grpc.FarmStub(channel).Hit(ask, metadata=metadata, timeout=20)


def test_a_small_hit_is_one_unary_call_and_a_large_one_or_a_miss_goes_on_to_get(gateway, store):
    small = _put(store, b"small artifact" * 20, guards=SMALL)  # stored in under 1 KiB
    reply = _hit(gateway, pb.Ask(key=KEY, sizes=[4], label="graph 1"))
    assert reply.header.source == "hit" and reply.header.encoding == "zstd"
    assert reply.header.digest == small.digest and reply.header.stored_size == len(reply.data)
    assert _decoded(reply.data) == b"small artifact" * 20 and not reply.stream

    missing = _hit(gateway, pb.Ask(key=KEY, sizes=[9]))  # no entry holds at 9
    assert missing.HasField("missing") and not missing.HasField("header")
    assert missing.missing.explanation.failed_guards  # as Get explains it

    large = _put(store, os.urandom(4000), guards=LARGE)  # stored in more than 1 KiB
    assert _hit(gateway, pb.Ask(key=KEY, sizes=[9])) == pb.HitReply(stream=True)
    events = _events(gateway, Stream(pb.GetRequest(ask=pb.Ask(key=KEY, sizes=[9]))))
    assert events[0].header.digest == large.digest  # Get streams it

    with pytest.raises(grpc.RpcError) as e:
        _hit(gateway, pb.Ask(key="0" * 63))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "key: 64" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        _hit(gateway, pb.Ask(key=KEY), metadata=[])
    assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_the_client_takes_a_small_hit_in_one_call_and_sends_a_miss_payload_with_its_ask(
    gateway, store, monkeypatch
):
    settings = ClientSettings(addr=gateway, token=TOKEN, progress=False)
    _put(store, b"small artifact" * 20, guards=SMALL)
    calls: list[str] = []
    stub = remote._stub(settings)
    for name in ("Hit", "Get"):
        method = getattr(stub, name)
        monkeypatch.setattr(
            stub, name, lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k)
        )
    got = remote.get(pb.Ask(key=KEY, sizes=[4]), None, settings)
    assert got.data == b"small artifact" * 20 and calls == ["Hit"]

    calls.clear()
    payload = pb.CompileRequest(graph=b"", target=TARGET)  # refused once read: it was sent
    with pytest.raises(remote.FarmError, match="empty graph payload"):
        remote.get(pb.Ask(key=KEY, sizes=[9]), payload, settings)
    assert calls == ["Hit", "Get"]
    with pytest.raises(remote.FarmError, match="no entry"):
        remote.get(pb.Ask(key=KEY, sizes=[9]), None, settings)  # a miss ends a prefetch


def test_a_gateway_without_the_hit_call_is_asked_with_get(redis_url, store, monkeypatch):
    """A gateway of an older release answers Hit UNIMPLEMENTED: the client remembers it and
    asks with Get only."""
    monkeypatch.setattr(server.FarmServicer, "Hit", pb_grpc.FarmServicer.Hit)
    settings = GatewaySettings(
        port=0, redis_url=redis_url, tenants=f"alice:{auth.hash_token(TOKEN)}", metrics_port=0
    )
    old, port = build_server(settings, store)
    old.start()
    try:
        _put(store, b"small artifact" * 20, guards=SMALL)
        client = ClientSettings(addr=f"127.0.0.1:{port}", token=TOKEN, progress=False)
        for _ in range(2):
            got = remote.get(pb.Ask(key=KEY, sizes=[4]), None, client)
            assert got.header.source == "hit" and got.data == b"small artifact" * 20
        assert client.addr in remote._without_hit
    finally:
        old.stop(0)


def test_an_ask_reuses_the_gateways_recent_read_yet_sees_entries_stored_or_dropped_since(store):
    coordinator = Coordinator(store, enqueue=None, compile_timeout_s=60)
    small = _put(store, b"small", guards=SMALL, created=1.0)
    assert _get(coordinator, sizes=[4]).entry.digest == small.digest  # the key's entries kept
    reads = []
    read = coordinator.recent.read
    coordinator.recent.read = lambda key: reads.append(key) or read(key)
    assert _get(coordinator, sizes=[4]).entry.digest == small.digest
    assert reads == []  # the hit storm's next ask: no index read

    large = _put(store, b"large", guards=LARGE, created=2.0)  # stored since the read
    assert _get(coordinator, sizes=[64]).entry.digest == large.digest  # read again, not a miss
    store.artifacts.drop(KEY, [large.digest])  # dropped since, with its blob
    assert _get(coordinator, sizes=[64]) is None
    assert _get(coordinator, sizes=[4]).entry.digest == small.digest
