"""Availability (issue 27, finding 1; issue 50, item 2): one tenant's idle streams never stall
another tenant's calls; strangers' streams (no token) hold a small pool of their own; while
strangers and two tenants hold every stream they can, another tenant's first ask is served;
a client refused because others hold the gateway's streams compiles locally at once. A real
gateway and redis-server with small caps; no worker (nothing here compiles)."""

import os
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

from torchfarm.contract import busy
from torchfarm.contract.cache_key import cache_key
from torchfarm.gateway import auth
from torchfarm.local_farm import LocalFarm
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc
from torchfarm.settings import GatewaySettings

A, B, C, D, E = (auth.make_token() for _ in range(5))
THREADS, TENANT_STREAMS, MESSAGE_TIMEOUT_S = 16, 4, 15
SETTINGS = GatewaySettings(threads=THREADS, tenant_max_streams=TENANT_STREAMS)
IDLE = 64  # four times the gateway's threads
TARGET = pb.Target(device="cpu", torch_version="2.13.0", python_version="3.11")
KEY = cache_key(b"a graph", TARGET, pb.Options())
# An entry whose stored bytes do not fit one message of this farm (TORCHFARM_CHUNK_BYTES):
# its hit is streamed by Get, in one of the tenant's stream slots.
LARGE_KEY, LARGE = cache_key(b"a large graph", TARGET, pb.Options()), os.urandom(4096)
CHUNK_BYTES = 1024


@pytest.fixture(scope="module")
def farm():
    with LocalFarm(
        workers=0,
        tenants=",".join(
            f"{name}:{auth.hash_token(token)}" for name, token in zip("abcde", (A, B, C, D, E))
        ),
        admins="",
        extra_env={
            "TORCHFARM_GATEWAY_THREADS": str(THREADS),
            "TORCHFARM_TENANT_MAX_STREAMS": str(TENANT_STREAMS),
            "TORCHFARM_GATEWAY_MESSAGE_TIMEOUT": str(MESSAGE_TIMEOUT_S),
            "TORCHFARM_CHUNK_BYTES": str(CHUNK_BYTES),
        },
    ) as f:
        f.store().artifacts.put(KEY, b"the artifact" * 100, pb.EntryMeta(tenant="b"))
        f.store().artifacts.put(LARGE_KEY, LARGE, pb.EntryMeta(tenant="b"))
        yield f


def _metadata(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


class Silent:
    """A request stream that sends `messages`, then nothing until released."""

    def __init__(self, *messages: pb.GetRequest):
        self.messages = messages
        self.release = threading.Event()

    def __iter__(self):
        yield from self.messages
        self.release.wait(120)


def _ends(calls) -> list[grpc.StatusCode]:
    """How each call ended (each waited for at most the client's own timeout)."""
    return [call.code() for call in calls]


def test_idle_streams_of_one_tenant_leave_another_tenant_served(farm):
    silent = Silent()
    with grpc.insecure_channel(farm.addr) as a, grpc.insecure_channel(farm.addr) as b:
        idle = [
            pb_grpc.FarmStub(a).Get(iter(silent), metadata=_metadata(A), timeout=90)
            for _ in range(IDLE)
        ]
        farm_b = pb_grpc.FarmStub(b)
        reply = farm_b.Lookup(pb.LookupRequest(key=KEY), metadata=_metadata(B), timeout=60)
        assert len(reply.candidates) == 1
        hit = list(
            farm_b.Get(
                iter([pb.GetRequest(ask=pb.Ask(key=KEY))]), metadata=_metadata(B), timeout=60
            )
        )
        assert hit[0].header.source == "hit" and hit[-1].WhichOneof("event") == "chunk"
        ends = _ends(idle)
        silent.release.set()
    # A's streams past its cap were refused at once; those it held were cancelled once no
    # ask came within the message timeout: none waited for the client's own deadline.
    assert ends.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == IDLE - TENANT_STREAMS
    assert ends.count(grpc.StatusCode.CANCELLED) == TENANT_STREAMS


def test_a_stream_silent_after_missing_is_cancelled(farm):
    unknown = cache_key(b"another graph", TARGET, pb.Options())
    silent = Silent(pb.GetRequest(ask=pb.Ask(key=unknown)))
    with grpc.insecure_channel(farm.addr) as channel:
        call = pb_grpc.FarmStub(channel).Get(iter(silent), metadata=_metadata(A), timeout=90)
        assert next(call).WhichOneof("event") == "missing"
        with pytest.raises(grpc.RpcError) as e:
            next(call)
        silent.release.set()
    assert e.value.code() is grpc.StatusCode.CANCELLED


def test_health_watches_hold_a_small_pool_of_their_own(farm):
    """Health and reflection take no token: their streams share a pool apart from the
    tenants' (a quarter of the threads those leave)."""
    pool = SETTINGS.unauthenticated_streams
    with grpc.insecure_channel(farm.addr) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watches = [
            health.Watch(health_pb2.HealthCheckRequest(), timeout=60)
            for _ in range(pool + TENANT_STREAMS)
        ]
        firsts = []
        for watch in watches:
            try:
                firsts.append(next(watch).status)
            except grpc.RpcError as e:
                firsts.append(e.code())
        reply = pb_grpc.FarmStub(channel).Lookup(
            pb.LookupRequest(key=KEY), metadata=_metadata(B), timeout=60
        )
        for watch in watches:
            watch.cancel()
    assert firsts.count(health_pb2.HealthCheckResponse.SERVING) == pool
    assert firsts.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == TENANT_STREAMS
    assert len(reply.candidates) == 1


def _hold_every_stream(channel: grpc.Channel, token: str, silent: Silent) -> list:
    """Twice a tenant's share of idle Get streams: it holds what it may, the rest are
    refused at once (waited for here)."""
    calls = [
        pb_grpc.FarmStub(channel).Get(iter(silent), metadata=_metadata(token), timeout=120)
        for _ in range(2 * TENANT_STREAMS)
    ]
    while sum(call.done() for call in calls) < TENANT_STREAMS:
        time.sleep(0.05)
    return calls


def _strangers(channel: grpc.Channel, silent: Silent) -> list:
    """Health watches and reflection streams, four times the gateway's threads: no token."""
    health = health_pb2_grpc.HealthStub(channel)
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    calls = [health.Watch(health_pb2.HealthCheckRequest(), timeout=120) for _ in range(THREADS)]
    calls += [reflection.ServerReflectionInfo(iter(silent), timeout=120) for _ in range(THREADS)]
    while sum(call.done() for call in calls) < len(calls) - SETTINGS.unauthenticated_streams:
        time.sleep(0.05)
    return calls


def _get(channel: grpc.Channel, token: str, key: str) -> list[pb.CompileEvent]:
    return list(
        pb_grpc.FarmStub(channel).Get(
            iter([pb.GetRequest(ask=pb.Ask(key=key))]), metadata=_metadata(token), timeout=60
        )
    )


def test_another_tenants_first_ask_is_served_while_strangers_and_two_tenants_hold_all(farm):
    """The re-probe's partial row: strangers (health watches, reflection) and two tenants
    hold every stream they can; a third tenant's first Get (a hit streamed in chunks: it
    needs a stream slot) is answered. bench/fair_streams.py times it."""
    silent = Silent()
    with grpc.insecure_channel(farm.addr) as channel, grpc.insecure_channel(farm.addr) as b:
        held = _strangers(channel, silent)
        held += _hold_every_stream(channel, A, silent) + _hold_every_stream(channel, C, silent)
        events = _get(b, B, LARGE_KEY)
        silent.release.set()
        for call in held:
            call.cancel()
    assert events[0].header.source == "hit" and events[-1].WhichOneof("event") == "chunk"
    assert b"".join(e.chunk for e in events if e.WhichOneof("event") == "chunk")


def test_a_client_refused_for_the_gateways_streams_compiles_locally_at_once(farm):
    """Four tenants hold all the gateway's streams (the third and fourth take the slots kept
    for a tenant's first stream): the fifth is refused with the gateway's scope, and its
    client does not ask again (that is for its own tenant's streams): FarmError, so the
    step compiles locally, never waiting its compile timeout on others' streams."""
    silent = Silent()
    with grpc.insecure_channel(farm.addr) as channel:
        held = [call for t in (A, C, D, E) for call in _hold_every_stream(channel, t, silent)]
        asking = _ask_for(farm, LARGE_KEY)
        out, err = asking.communicate(timeout=120)
        silent.release.set()
        for call in held:
            call.cancel()
    assert asking.returncode != 0 and not out
    assert "RESOURCE_EXHAUSTED: the gateway has no stream free for b" in err, err[-2000:]
    assert "the farm is busy" not in err  # not asked again


def test_a_client_refused_a_slot_asks_again_and_gets_its_hit(farm):
    """A fleet's ranks outnumber the slots while their graph compiles: a refused stream says
    when to ask again (contract/busy.py), and the client waits and asks again instead of
    failing (and compiling locally). A small hit needs no slot: it is one unary Hit call.
    The clients are processes of their own: no gRPC threads of their channels stay in the
    test process, which forks compile children in other tests."""
    silent = Silent()
    with grpc.insecure_channel(farm.addr) as channel:
        stub = pb_grpc.FarmStub(channel)
        done = threading.Semaphore(0)
        calls = []
        for _ in range(TENANT_STREAMS + 1):  # one more than B's slots: one refused at once
            calls.append(stub.Get(iter(silent), metadata=_metadata(B), timeout=90))
            calls[-1].add_done_callback(lambda _: done.release())
        assert done.acquire(timeout=30)
        (refused,) = [call for call in calls if call.done()]
        small = _ask_for(farm, KEY)
        assert small.communicate(timeout=60)[0].split() == ["hit", str(len(b"the artifact" * 100))]
        asking = _ask_for(farm, LARGE_KEY)
        time.sleep(8)  # it starts, is refused, and asks again until the slots free
        assert asking.poll() is None, asking.communicate()  # still asking: no error, no result
        silent.release.set()  # the held streams end: slots free
        out, err = asking.communicate(timeout=60)
        _ends(calls)
    assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (busy.RETRY_AFTER_MS, str(busy.STREAM_RETRY_AFTER_MS)) in refused.trailing_metadata()
    assert asking.returncode == 0, err[-2000:]
    assert "the farm is busy" in err
    assert out.split() == ["hit", str(len(LARGE))]


def _ask_for(farm, key: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", ASK_FOR_KEY, farm.addr, B, key],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# The retrying client: asks for a key as tenant B, prints the source and the bytes received.
ASK_FOR_KEY = """
import logging, sys
from torchfarm.client import remote
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings
logging.basicConfig(level=logging.INFO)
addr, token, key = sys.argv[1:]
settings = ClientSettings(addr=addr, token=token, progress=False, compile_timeout_s=60)
got = remote.get(pb.Ask(key=key), None, settings)
print(got.header.source, len(got.data))
"""
