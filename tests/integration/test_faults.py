"""Faults on a farm of the file's own: each test breaks a part and checks that nothing was lost.
The farm's start costs more than most tests, and so does each compile: the entry both Redis
tests start from (an inference MLP) is compiled once for the file (`mlp_entry`), and each test
compiles only the graphs it checks a fault with, graphs no other test here compiles."""

import signal
import socket
import time

import pytest
import redis

from tests.integration.helpers import run_client
from torchfarm.cache import keys
from torchfarm.local_farm import LocalFarm

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def farm():
    # The broker (queues, job state) on its own redis-server, as in docker-compose.yml.
    with LocalFarm(separate_broker=True) as farm:
        yield farm


@pytest.fixture(scope="module")
def mlp_entry(farm) -> dict:
    """The first compile of the file's farm, an inference MLP: the entry already stored that
    each Redis test checks is kept through its fault."""
    return run_client(farm, "model_client.py", "mlp", "infer")


def test_redis_restart_keeps_every_entry_and_the_farm_reconnects_by_itself(farm, mlp_entry):
    assert mlp_entry["sources"] == ["miss"]
    store = farm.store()
    entries = {key: store.artifacts.entries(key) for key, _ in store.artifacts.keys()}
    assert entries
    time.sleep(1.5)  # appendfsync everysec: the last write is on disk after 1 s
    for name in ("broker", "redis"):
        farm.stop_process(name, signal.SIGKILL)  # a crash, not a clean shutdown
    for name in ("broker", "redis"):
        farm.start_redis(name)  # same port and directory: replays the AOF
    assert {key: store.artifacts.entries(key) for key, _ in store.artifacts.keys()} == entries
    # The gateway and the worker were never restarted: they reconnect on their own.
    hit = run_client(farm, "model_client.py", "mlp", "infer")
    assert hit["sources"] == ["hit"] and hit["out_err"] < 1e-5
    miss = run_client(farm, "model_client.py", "mlp12", "infer")
    assert miss["sources"] == ["miss"] and miss["out_err"] < 1e-4


def test_a_full_cache_redis_still_compiles_and_serves_without_caching(farm, mlp_entry):
    assert mlp_entry["sources"] == ["miss"]
    store = farm.store()
    stored = {(r["key"], r["digest"]) for r in store.rows()}
    # The cache's Redis is past its memory limit: it refuses every write.
    store.artifacts.redis.config_set("maxmemory-policy", "noeviction")
    store.artifacts.redis.config_set(
        "maxmemory", store.artifacts.redis.info("memory")["used_memory"] // 2
    )
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        store.artifacts.redis.set("someone-else", b"x")
    full = run_client(farm, "model_client.py", "mlp", "train")
    assert full["sources"] == ["miss"] and full["out_err"] < 1e-4  # the farm compiled it
    hit = run_client(farm, "model_client.py", "mlp", "infer")
    assert hit["sources"] == ["hit"] and hit["out_err"] < 1e-4  # old entries still served
    assert {(r["key"], r["digest"]) for r in store.rows()} == stored, store.rows()
    assert all(proc.poll() is None for proc in farm.procs.values())
    # Room again: the next compile of the same graph is cached, and then hits.
    store.artifacts.redis.config_set("maxmemory", 0)
    assert run_client(farm, "model_client.py", "mlp", "train")["sources"] == ["miss"]
    assert len(store.rows()) == len(stored) + 1
    assert run_client(farm, "model_client.py", "mlp", "train")["sources"] == ["hit"]


@pytest.mark.parametrize(
    "where", ["a stopped gateway (closed port)", "a hung gateway (accepts TCP, never answers)"]
)
def test_a_client_decides_the_farm_is_down_within_the_connect_timeout(where):
    from torchfarm.client import remote
    from torchfarm.local_farm import free_port
    from torchfarm.settings import ClientSettings

    hung = socket.create_server(("127.0.0.1", 0))  # listens; the kernel completes handshakes
    addr = (
        f"127.0.0.1:{free_port()}"
        if where.startswith("a stopped")
        else f"127.0.0.1:{hung.getsockname()[1]}"
    )
    settings = ClientSettings.from_env(addr=addr)  # the default connect timeout: 2 s
    started = time.monotonic()
    with pytest.raises(remote.FarmError, match="unreachable"):
        remote.lookup("0" * 64, settings)
    assert time.monotonic() - started < settings.connect_timeout_s + 0.5
    hung.close()


def test_a_failed_enqueue_leaves_no_claim_and_the_next_client_compiles(farm):
    # The broker refuses Celery's send (LPUSH) after the gateway has claimed the job, as a
    # full or failing broker does; the claim must not outlive the failure.
    from tests.integration.helpers import direct_request
    from torchfarm.client import remote
    from torchfarm.settings import ClientSettings

    store = farm.store()
    settings = ClientSettings(addr=farm.addr)
    import torch

    request = direct_request(
        torch.nn.Sequential(torch.nn.Linear(3, 17), torch.nn.Tanh()), torch.randn(2, 3)
    )
    broker = store.jobs.redis
    broker.execute_command("ACL", "SETUSER", "default", "-lpush")
    try:
        with pytest.raises(remote.FarmError, match="UNAVAILABLE: the farm could not queue"):
            remote.fetch(request, settings)
    finally:
        broker.execute_command("ACL", "SETUSER", "default", "+lpush")
    assert not list(broker.scan_iter(match=keys.claim("*")))  # released, not left to expire
    header, _ = remote.fetch(request, settings)  # queued at once, no claim's expiry to wait
    assert header.source == "miss"
