"""Faults on a farm of its own: each test breaks a part and checks that nothing was lost."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import redis

from tests.integration.helpers import HERE, run_client
from torchfarm.cache import keys
from torchfarm.cache.store import Store
from torchfarm.local_farm import LocalFarm
from torchfarm.proto import torchfarm_pb2 as pb

pytestmark = pytest.mark.integration


def test_redis_restart_keeps_every_entry_and_the_farm_reconnects_by_itself():
    with LocalFarm() as farm:
        assert run_client(farm, "model_client.py", "mlp", "infer")["sources"] == ["miss"]
        store = farm.store()
        entries = {key: store.artifacts.entries(key) for key, _ in store.artifacts.keys()}
        assert entries
        time.sleep(1.5)  # appendfsync everysec: the last write is on disk after 1 s
        farm.stop_process("redis", signal.SIGKILL)  # a crash, not a clean shutdown
        farm.start_redis()  # same port and directory: replays the AOF
        assert {key: store.artifacts.entries(key) for key, _ in store.artifacts.keys()} == entries
        # The gateway and the worker were never restarted: they reconnect on their own.
        hit = run_client(farm, "model_client.py", "mlp", "infer")
        assert hit["sources"] == ["hit"] and hit["out_err"] < 1e-5
        miss = run_client(farm, "model_client.py", "cnn", "infer")
        assert miss["sources"] == ["miss"] and miss["out_err"] < 1e-4


def test_a_full_cache_redis_still_compiles_and_serves_without_caching():
    # The broker (queues, job state) on its own redis-server, as in docker-compose.yml.
    with LocalFarm(separate_broker=True) as farm:
        assert run_client(farm, "model_client.py", "mlp", "infer")["sources"] == ["miss"]
        store = farm.store()
        stored = {(r["key"], r["digest"]) for r in store.rows()}
        # The cache's Redis is past its memory limit: it refuses every write.
        store.artifacts.redis.config_set("maxmemory-policy", "noeviction")
        store.artifacts.redis.config_set(
            "maxmemory", store.artifacts.redis.info("memory")["used_memory"] // 2
        )
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            store.artifacts.redis.set("someone-else", b"x")
        full = run_client(farm, "model_client.py", "cnn", "infer")
        assert full["sources"] == ["miss"] and full["out_err"] < 1e-4  # the farm compiled it
        hit = run_client(farm, "model_client.py", "mlp", "infer")
        assert hit["sources"] == ["hit"] and hit["out_err"] < 1e-5  # old entries still served
        assert {(r["key"], r["digest"]) for r in store.rows()} == stored, store.rows()
        assert all(proc.poll() is None for proc in farm.procs.values())
        # Room again: the next compile of the same graph is cached, and then hits.
        store.artifacts.redis.config_set("maxmemory", 0)
        assert run_client(farm, "model_client.py", "cnn", "infer")["sources"] == ["miss"]
        assert len(store.rows()) == len(stored) + 1
        assert run_client(farm, "model_client.py", "cnn", "infer")["sources"] == ["hit"]


def _start_client(farm, *args: str) -> subprocess.Popen:
    env = dict(
        os.environ,
        TORCHFARM_ADDR=farm.addr,
        TORCHFARM_PROGRESS="0",
        TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(),
        TRITON_CACHE_DIR=tempfile.mkdtemp(),
    )
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "clients", "model_client.py"), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_stage(store: Store, stage: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(
            store.jobs.redis.get(k) == str(stage).encode()
            for k in store.jobs.redis.scan_iter(match=keys.stage("*"))
        ):
            return
        time.sleep(0.2)
    name = pb.Progress.Stage.Name(stage)
    raise AssertionError(f"no job reached {name} in {timeout_s:.0f} s")


def test_a_worker_killed_mid_compile_hands_the_compile_to_another_worker():
    # Redelivery waits for the broker's visibility timeout: shortened here (it must exceed
    # the compile timeout), 1900 s by default.
    with LocalFarm(
        extra_env={"TORCHFARM_COMPILE_TIMEOUT_WORKER": "50", "TORCHFARM_REDELIVERY_TIMEOUT": "55"}
    ) as farm:
        store = farm.store()
        client = _start_client(farm, "mlp", "train")
        _wait_for_stage(store, pb.Progress.COMPILING, timeout_s=120)
        farm.stop_process("worker0", signal.SIGKILL)  # the worker, its pool and its sandbox
        farm.start_worker("worker1")
        out, err = client.communicate(timeout=400)
        assert client.returncode == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["sources"] == ["miss"], err[-2000:]  # the farm's artifact, not a fallback
        assert result["out_err"] < 1e-4 and result["grad_err"] < 1e-4
        assert store.counters.farm().get("compiles") == 1  # the killed compile stored nothing


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


def test_a_failed_enqueue_leaves_no_claim_and_the_next_client_compiles():
    # The broker refuses Celery's send (LPUSH) after the gateway has claimed the job, as a
    # full or failing broker does; the claim must not outlive the failure.
    from tests.integration.helpers import direct_request
    from torchfarm.client import remote
    from torchfarm.settings import ClientSettings

    with LocalFarm() as farm:
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
