"""The gRPC servicer on a real server and a bare redis-server: what it adds to the
coordinator (authentication and its failure limit, stream caps, streaming a hit in bounded
pieces)."""

import collections
import itertools
import threading
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from torchfarm.cache.pools import Readiness
from torchfarm.cache.store import Store
from torchfarm.gateway import auth
from torchfarm.gateway.server import POOL_HEALTH_PREFIX, build_server, warn_if_open
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc
from torchfarm.settings import GatewaySettings

TOKEN = "alice-token-0123456789"  # a legacy token (not made by `torchfarm token`)
CAROL, ADMIN = auth.make_token(), auth.make_token()


@pytest.fixture
def gateway(redis_url):
    """A gateway with two tenants (alice's token a legacy one) and an admin, on every
    loopback address: 127.0.0.1 and ::1 are two peers of it."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    settings = GatewaySettings(
        host="[::]",
        port=0,
        redis_url=redis_url,
        tenants=f"alice:{auth.hash_token(TOKEN)},carol:{auth.hash_token(CAROL)}",
        admins=f"ops:{auth.hash_token(ADMIN)}",
        metrics_port=0,
        auth_failures=3,
        threads=8,
        tenant_max_streams=2,
    )
    server, port = build_server(settings, Store.from_clients(client))
    server.start()
    yield port
    server.stop(0)
    client.flushdb()


def _lookup(addr: str, token: str) -> grpc.StatusCode:
    with grpc.insecure_channel(addr) as channel:
        try:
            pb_grpc.FarmStub(channel).Lookup(
                pb.LookupRequest(key="0" * 64),
                metadata=[("authorization", f"Bearer {token}")],
                timeout=10,
            )
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_failed_authentications_are_limited_per_peer(gateway):
    guesser, other = f"127.0.0.1:{gateway}", f"[::1]:{gateway}"
    assert [_lookup(guesser, f"guess-{i}") for i in range(3)] == [
        grpc.StatusCode.UNAUTHENTICATED
    ] * 3
    # Over its budget the peer is refused before its token is looked at, even a valid one.
    assert _lookup(guesser, "guess-4") is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _lookup(guesser, TOKEN) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _lookup(other, TOKEN) is grpc.StatusCode.OK  # another peer is not affected


def _stats(addr: str, token: str | None) -> grpc.StatusCode:
    with grpc.insecure_channel(addr) as channel:
        try:
            metadata = [("authorization", f"Bearer {token}")] if token else []
            pb_grpc.AdminStub(channel).Stats(pb.StatsRequest(), metadata=metadata, timeout=10)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_a_guesser_at_the_admins_public_id_never_refuses_the_admin(gateway):
    addr, admin_id = f"127.0.0.1:{gateway}", auth.token_id(ADMIN)
    guesses = [_stats(addr, f"tf_{admin_id}_{i:043d}") for i in range(4)]
    assert guesses == [grpc.StatusCode.UNAUTHENTICATED] * 3 + [grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert _stats(addr, ADMIN) is grpc.StatusCode.OK  # guesses spent the address's, not its
    assert _stats(addr, CAROL) is grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("tenant", ["carol (a made token)", "alice (legacy, on her channel)"])
def test_a_tenants_asks_are_all_served_while_a_stranger_guesses_at_full_speed(gateway, tenant):
    """Issue 50, item 3: a stranger at the tenant's address guesses as fast as it can, with
    the tenant's public token id (or legacy-form tokens); the tenant asks 40 times on its
    channel, and all 40 are served."""
    addr = f"127.0.0.1:{gateway}"
    token = CAROL if tenant.startswith("carol") else TOKEN
    guess = f"tf_{auth.token_id(CAROL)}_" + "{:043d}" if token == CAROL else "guess-{}"
    stop, answers = threading.Event(), collections.Counter()

    def guessing() -> None:
        with grpc.insecure_channel(addr) as channel:
            farm = pb_grpc.FarmStub(channel)
            for i in itertools.count():
                if stop.is_set():
                    return
                metadata = [("authorization", f"Bearer {guess.format(i)}")]
                try:
                    farm.Lookup(pb.LookupRequest(key="0" * 64), metadata=metadata, timeout=10)
                except grpc.RpcError as e:
                    answers[e.code()] += 1

    with grpc.insecure_channel(addr) as channel:
        farm, metadata = pb_grpc.FarmStub(channel), [("authorization", f"Bearer {token}")]
        farm.Lookup(pb.LookupRequest(key="0" * 64), metadata=metadata, timeout=10)  # connects
        stranger = threading.Thread(target=guessing)
        stranger.start()
        try:
            while answers[grpc.StatusCode.RESOURCE_EXHAUSTED] < 10:  # the address is limited
                time.sleep(0.01)
            served = 0
            for _ in range(40):
                farm.Lookup(pb.LookupRequest(key="0" * 64), metadata=metadata, timeout=10)
                served += 1
        finally:
            stop.set()
            stranger.join()
    print(f"{tenant}: {served} of 40 asks served among {sum(answers.values())} guesses")
    assert served == 40
    assert answers[grpc.StatusCode.RESOURCE_EXHAUSTED] > answers[grpc.StatusCode.UNAUTHENTICATED]


def test_a_strangers_failures_never_refuse_a_valid_token_at_the_same_address(gateway):
    addr = f"127.0.0.1:{gateway}"
    for i in range(8):
        for token in (None, f"guess-{i}", auth.make_token()):
            assert _lookup(addr, token) in (
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        assert _lookup(addr, CAROL) is grpc.StatusCode.OK
        assert _stats(addr, ADMIN) is grpc.StatusCode.OK


def test_a_tenant_past_its_stream_cap_is_refused_at_once_and_others_served(gateway):
    """Two idle Get streams fill alice's cap: her next stream (a Compile too) is refused
    without waiting; carol's are not."""
    addr, release = f"127.0.0.1:{gateway}", threading.Event()

    def silent():
        release.wait(30)
        yield from ()

    def compile_status(token: str) -> grpc.StatusCode:
        metadata = [("authorization", f"Bearer {token}")]
        try:
            list(farm.Compile(pb.CompileRequest(), metadata=metadata, timeout=10))
        except grpc.RpcError as e:
            return e.code()
        return grpc.StatusCode.OK

    with grpc.insecure_channel(addr) as channel:
        farm = pb_grpc.FarmStub(channel)
        metadata = [("authorization", f"Bearer {TOKEN}")]
        idle = [farm.Get(silent(), metadata=metadata, timeout=30) for _ in range(2)]
        deadline = time.monotonic() + 20  # until the gateway holds both idle streams
        while (alice := compile_status(TOKEN)) is grpc.StatusCode.INVALID_ARGUMENT:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert alice is grpc.StatusCode.RESOURCE_EXHAUSTED
        # carol has slots: her (empty) Compile is read and refused for what it is
        assert compile_status(CAROL) is grpc.StatusCode.INVALID_ARGUMENT
        assert _lookup(addr, TOKEN) is grpc.StatusCode.OK  # short calls take no slot
        for call in idle:
            call.cancel()
        release.set()


def test_a_peer_is_its_address_without_the_port():
    assert auth.peer_address("ipv4:10.0.0.7:51234") == "ipv4:10.0.0.7"
    assert auth.peer_address("ipv6:[::1]:40000") == "ipv6:[::1]"
    assert auth.peer_address("unix:/tmp/sock") == "unix:/tmp/sock"


@pytest.mark.parametrize(
    "host, tenants, loud",
    [
        ("0.0.0.0", "", True),
        ("[::]", "", True),
        ("10.1.2.3", "", True),
        ("127.0.0.1", "", False),
        ("[::1]", "", False),
        ("localhost", "", False),
        ("0.0.0.0", f"alice:{auth.hash_token(TOKEN)}", False),
    ],
)
def test_an_open_gateway_on_a_reachable_address_warns_loudly(host, tenants, loud, caplog):
    settings = GatewaySettings(host=host, tenants=tenants)
    assert warn_if_open(settings) is loud
    assert ("OPEN GATEWAY" in caplog.text) is loud


def test_health_and_info_report_each_pool_and_why_it_cannot_compile(gateway, redis_url):
    store, serving = (
        Store.from_clients(redis.Redis.from_url(redis_url)),
        health_pb2.HealthCheckResponse,
    )
    with grpc.insecure_channel(f"127.0.0.1:{gateway}") as channel:
        health = health_pb2_grpc.HealthStub(channel)

        def status(service: str):
            request = health_pb2.HealthCheckRequest(service=service)
            return health.Check(request, timeout=10).status

        def info() -> list:
            metadata = [("authorization", f"Bearer {TOKEN}")]
            return list(
                pb_grpc.FarmStub(channel)
                .Info(pb.InfoRequest(), metadata=metadata, timeout=10)
                .pools
            )

        assert info() == []
        store.pools.register("cpu-a", "w1", {"describe": "pool a"}, Readiness())
        sizes = {"concurrency": 2, "warm_children": 3}
        store.pools.register(
            "cpu-b", "w2", {"describe": "pool b", **sizes}, Readiness("ready", "", 1.0)
        )
        assert status(POOL_HEALTH_PREFIX + "cpu-a") == serving.NOT_SERVING  # starting
        assert status(POOL_HEALTH_PREFIX + "cpu-b") == serving.SERVING
        store.pools.register("cpu-a", "w1", {}, Readiness("failed", "ImportError: no ops", 2.0))
        assert status(POOL_HEALTH_PREFIX + "cpu-a") == serving.NOT_SERVING
        assert status("") == serving.SERVING  # the gateway still serves hits
        assert info() == [
            pb.PoolHealth(
                name="cpu-a",
                describe="",
                state=pb.PoolHealth.FAILED,
                error="ImportError: no ops",
                workers=1,
            ),
            pb.PoolHealth(
                name="cpu-b",
                describe="pool b",
                state=pb.PoolHealth.READY,
                workers=1,
                ready_workers=1,
                compile_slots=2,  # the pool's size, for doctor and operators
                warm_children=3,
            ),
        ]
        store.pools.redis.flushdb()  # every worker gone
        assert status(POOL_HEALTH_PREFIX + "cpu-b") == serving.SERVICE_UNKNOWN
