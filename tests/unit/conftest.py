"""The unit tier: no farm. Store tests get a bare redis-server of their own."""

import shutil
import subprocess
import tempfile
import time

import pytest
import redis

from torchfarm.local_farm import free_port


@pytest.fixture(scope="session")
def redis_url():
    """A real redis-server on a free loopback port, for this session only."""
    server = shutil.which("redis-server")
    if not server:
        pytest.fail("redis-server not found: run `make deps`")
    port, directory = free_port(), tempfile.mkdtemp(prefix="torchfarm-unit-redis-")
    proc = subprocess.Popen(
        [
            server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            directory,
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)
    shutil.rmtree(directory, ignore_errors=True)
