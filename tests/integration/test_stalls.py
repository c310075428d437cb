"""Faults that used to stall training, each on a farm of its own: a gateway that hangs
while a client waits, compiles nobody waits for any more, and an artifact that inflates
enormously in the gateway's memory."""

import concurrent.futures
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import pytest
import torch

from tests.integration.helpers import HERE, TOKENS, direct_request
from torchfarm.cache import keys
from torchfarm.cache.store import Store
from torchfarm.client import remote
from torchfarm.contract.cache_key import public_key
from torchfarm.gateway.auth import hash_token
from torchfarm.local_farm import LocalFarm
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc
from torchfarm.settings import ClientSettings

pytestmark = pytest.mark.integration
INACTIVITY_S = 5  # TORCHFARM_INACTIVITY_TIMEOUT of the client below (default 15)


def _wait_for(what: str, condition, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def farm():
    """An open farm of this file's own (its gateway is stopped and measured here), shared by the
    tests that need nothing else: a farm's start costs more than most of them."""
    with LocalFarm() as farm:
        yield farm


def _claimed(store: Store) -> bool:
    return any(store.jobs.redis.scan_iter(match=keys.claim("*")))


def test_a_hung_gateway_costs_the_step_the_inactivity_limit_and_a_local_compile(farm):
    client = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "clients", "model_client.py"), "mlp", "infer"],
        env=dict(
            os.environ,
            TORCHFARM_ADDR=farm.addr,
            TORCHFARM_PROGRESS="0",
            TORCHFARM_INACTIVITY_TIMEOUT=str(INACTIVITY_S),
            TORCHFARM_COMPILE_TIMEOUT="600",
            TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(),
            TRITON_CACHE_DIR=tempfile.mkdtemp(),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    gave_up = threading.Event()
    errors: list[str] = []

    def read_stderr() -> None:
        for line in client.stderr:
            errors.append(line)
            if "farm unavailable" in line:
                gave_up.set()

    threading.Thread(target=read_stderr, daemon=True).start()
    store = farm.store()
    _wait_for("the client's compile request", lambda: _claimed(store))
    gateway = farm.procs["gateway"].pid
    os.kill(gateway, signal.SIGSTOP)  # hangs: its connections stay open, nothing comes
    try:
        stopped = time.monotonic()
        assert gave_up.wait(INACTIVITY_S + 60), "".join(errors)[-3000:]
        waited = time.monotonic() - stopped
        out = client.stdout.read()
        assert client.wait(timeout=600) == 0, "".join(errors)[-3000:]
    finally:
        os.kill(gateway, signal.SIGCONT)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["sources"] == ["local"]  # compiled locally, once
    assert "farm silent for 5 s" in result["whys"][0]
    assert result["out_err"] < 1e-4  # equal to eager
    # Not the 600 s compile timeout: the inactivity limit, plus a loaded machine's margin.
    assert waited < INACTIVITY_S + 30
    assert sum("farm unavailable" in line for line in errors) == 1  # one warning


def _request(width: int) -> pb.CompileRequest:
    return direct_request(
        torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Softplus()), torch.randn(2, 3)
    )


def _send_then_cancel(settings: ClientSettings, request: pb.CompileRequest) -> None:
    """A compile request whose client goes away once it is queued (as a killed trainer)."""
    stub = pb_grpc.FarmStub(remote.channel(settings.addr))
    call = stub.Compile(
        request, metadata=[("authorization", f"Bearer {settings.token}")], timeout=600
    )
    first = next(call)
    assert first.WhichOneof("event") == "progress", first
    call.cancel()


def test_compiles_nobody_waits_for_are_skipped_and_the_limit_counts_queued_work():
    tokens = dict(TOKENS, carol="carol-token-1111111111")
    tenants = ",".join(f"{name}:{hash_token(tok)}" for name, tok in tokens.items())
    # One compile at once: bob's keeps the worker busy while alice's wait in the queue.
    env = {"TORCHFARM_TENANT_MAX_COMPILES": "2", "TORCHFARM_WORKER_CONCURRENCY": "1"}
    with LocalFarm(tenants=tenants, extra_env=env) as farm:
        store = farm.store()
        alice = ClientSettings(addr=farm.addr, token=tokens["alice"])
        bob = dataclasses.replace(alice, token=tokens["bob"])
        carol = dataclasses.replace(alice, token=tokens["carol"])
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            busy = pool.submit(remote.fetch, _request(21), bob)  # the one worker is busy
            _wait_for("bob's compile", lambda: _claimed(store))
            _send_then_cancel(alice, _request(22))
            _send_then_cancel(alice, _request(23))
            # Sent after the others' RPCs ended, while their jobs are still queued: refused.
            with pytest.raises(remote.FarmError, match="RESOURCE_EXHAUSTED.*queued or running"):
                remote.fetch(_request(24), alice)
            carols = pool.submit(remote.fetch, _request(25), carol)
            assert busy.result(timeout=600)[0].source == "miss"
            assert carols.result(timeout=600)[0].source == "miss"
        stats = store.counters.farm()
        assert stats.get("abandoned") == 2  # alice's two compiles were skipped, not run
        assert stats.get("compiles") == 2  # bob's and carol's only
        assert remote.fetch(_request(24), alice)[0].source == "miss"  # her slots are free


def _plant(store: Store, key: str, data: bytes) -> None:
    """An entry for `key` as a worker writes one (the one place that plants entries here)."""
    store.artifacts.put(key, data, pb.EntryMeta(tenant="alice", pool="test", compile_seconds=1))


def _memory_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1])


def _drain(addr: str, request: pb.CompileRequest) -> tuple[int, int]:
    """Stream one artifact, keeping nothing: (the header's size, the bytes received)."""
    size = received = 0
    with grpc.insecure_channel(addr, options=remote.KEEPALIVE) as channel:
        for event in pb_grpc.FarmStub(channel).Compile(request, timeout=600):
            if event.WhichOneof("event") == "header":
                size = event.header.size
            elif event.WhichOneof("event") == "chunk":
                received += len(event.chunk)
    return size, received


def test_an_artifact_that_inflates_enormously_costs_the_gateway_a_chunk_per_stream(farm):
    artifact = bytes(300 << 20)  # 300 MB of zeros: about 30 KB stored
    request = _request(26)
    _plant(farm.store(), public_key(request.graph, request.target, request.options), artifact)
    gateway = farm.procs["gateway"].pid
    before = _memory_kib(gateway, "VmRSS")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: _drain(farm.addr, request), range(4)))
    assert results == [(len(artifact), len(artifact))] * 4
    grown_mib = (_memory_kib(gateway, "VmHWM") - before) / 1024
    assert grown_mib < 150, f"the gateway grew by {grown_mib:.0f} MiB"
