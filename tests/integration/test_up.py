"""`torchfarm up`: prints TORCHFARM_ADDR when ready, starts a worker that exits again, SIGTERM
leaves no process behind, and it is closed where asked: tenants from the environment are
honoured, its Redis wants a password."""

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.helpers import TOKENS
from torchfarm.gateway.auth import hash_token
from torchfarm.local_farm import free_port
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration


def _descendants(pid: int) -> set[int]:
    children = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout.split()
    found = {int(c) for c in children}
    for child in list(found):
        found |= _descendants(child)
    return found


def _workers(pids: set[int]) -> list[int]:
    """The `torchfarm worker` processes among `pids` (not their compile children)."""
    found = []
    for pid in pids:
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"-m" not in argv:
            continue
        if argv[argv.index(b"-m") + 1 : argv.index(b"-m") + 3] == [b"torchfarm", b"worker"]:
            found.append(pid)
    return found


def _compile_status(channel, token: str | None) -> grpc.StatusCode:
    """The status of a Compile with an empty graph: INVALID_ARGUMENT once authenticated."""
    metadata = [("authorization", f"Bearer {token}")] if token else []
    with pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.FarmStub(channel).Compile(pb.CompileRequest(), metadata=metadata, timeout=10))
    return e.value.code()


def test_up_prints_address_serves_honours_tenants_and_stops_cleanly():
    # Started with tenants in the environment (it once overrode them with an open farm).
    redis_port = free_port()
    env = dict(os.environ, TORCHFARM_TENANTS=f"alice:{hash_token(TOKENS['alice'])}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchfarm", "up", "--grpc-port", "0"]
        + ["--redis-port", str(redis_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("TORCHFARM_ADDR=127.0.0.1:"), line
        addr = line.split("=", 1)[1]
        with grpc.insecure_channel(addr) as channel:
            status = (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(), timeout=5)
                .status
            )
            assert status == health_pb2.HealthCheckResponse.SERVING
            assert _compile_status(channel, None) == grpc.StatusCode.UNAUTHENTICATED
            assert _compile_status(channel, "wrong") == grpc.StatusCode.UNAUTHENTICATED
            assert _compile_status(channel, TOKENS["alice"]) == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(redis.AuthenticationError):  # no password, no cache
            redis.Redis(port=redis_port, socket_timeout=5).get("tf1:stats")
        started = _descendants(proc.pid)
        assert len(started) >= 4  # two redis-servers (cache, broker), gateway, worker
        # A worker that exits (killed here; a full Redis once ended one) is started again.
        worker = _workers(started)
        assert len(worker) == 1, worker
        os.kill(worker[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not set(_workers(_descendants(proc.pid))) - set(worker):
            assert time.monotonic() < deadline, "the killed worker was not started again"
            time.sleep(0.5)
        started = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        alive = started
        while alive and time.monotonic() < deadline:
            alive = {
                p
                for p in started
                if os.path.exists(f"/proc/{p}")
                and "Z" not in open(f"/proc/{p}/stat").read().split()[2]
            }
            time.sleep(0.2)
        assert not alive, f"left running: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
