"""`torchfarm up`: prints TORCHFARM_ADDR when ready, and SIGTERM leaves no process behind."""

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.integration


def _descendants(pid: int) -> set[int]:
    children = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout.split()
    found = {int(c) for c in children}
    for child in list(found):
        found |= _descendants(child)
    return found


def test_up_prints_address_serves_and_stops_cleanly():
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchfarm", "up", "--grpc-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
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
        started = _descendants(proc.pid)
        assert len(started) >= 3  # redis-server, gateway, worker (and its pool)
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
