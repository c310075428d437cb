"""`torchfarm up`: prints the operator's block (address, an admin token the cache CLI works
with alone, the recovery command) when ready, starts a worker that exits again, SIGTERM (or
SIGKILL) leaves no process behind, and it is closed where asked: tenants from the
environment are honoured, its Redis wants a password."""

import os
import re
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


def _operator_block(proc) -> dict[str, str]:
    """`torchfarm up`'s block: NAME=value lines (the first is the address) and `# ` notes,
    up to an empty line; the recovery command's file under "recovery", its blob store under
    "blobs"."""
    values: dict[str, str] = {}
    while (line := proc.stdout.readline().rstrip("\n")) != "":
        if line.startswith("# recovery"):
            values["recovery"] = re.search(r'"\$\(cat (\S+)\)"', line).group(1)
            values["blobs"] = re.search(r"TORCHFARM_BLOB_URL=(\S+)", line).group(1)
        elif not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name] = value
    return values


def _cache(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchfarm", "cache", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _operate_with_what_up_printed(block: dict[str, str], tmp_path) -> None:
    """The cache CLI with nothing but the block's two lines: an environment without any store
    credential or Redis URL; a tenant's token in their place is refused."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFARM_")}
    env.update(
        TORCHFARM_ADDR=block["TORCHFARM_ADDR"],
        TORCHFARM_ADMIN_TOKEN=block["TORCHFARM_ADMIN_TOKEN"],
    )
    bundle = str(tmp_path / "empty.tfbundle")
    for args, expected in [
        (["stats", "--json"], '"entries": 0'),
        (["ls", "--json"], "[]"),
        (["export", bundle], "exported 0 entries"),
        (["import", bundle], "imported 0 entries"),
        (["purge", "--all"], "removed 0 keys"),
    ]:
        done = _cache(env, *args)
        assert done.returncode == 0 and expected in done.stdout, (args, done.stderr)
    missing = _cache(env, "rm", "abcd")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    tenant = _cache(dict(env, TORCHFARM_ADMIN_TOKEN=TOKENS["alice"]), "stats")
    assert tenant.returncode == 1 and "PERMISSION_DENIED" in tenant.stderr
    with open(block["recovery"]) as f:  # the recovery mode: the store itself, no gateway
        url = f.read()
    recovery_env = dict(env, TORCHFARM_ADDR="", TORCHFARM_BLOB_URL=block["blobs"])
    direct = _cache(recovery_env, "stats", "--json", "--redis", url)
    assert direct.returncode == 0 and '"entries": 0' in direct.stdout, direct.stderr


def test_up_prints_address_serves_honours_tenants_and_stops_cleanly(tmp_path):
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
        block = _operator_block(proc)
        assert block["TORCHFARM_ADDR"].startswith("127.0.0.1:"), block
        addr = block["TORCHFARM_ADDR"]
        _operate_with_what_up_printed(block, tmp_path)
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
        alive = _alive_after(started, 10)
        assert not alive, f"left running: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive_after(pids: set[int], seconds: float) -> set[int]:
    """Those of `pids` still running (not zombies) once `seconds` have passed, or fewer."""
    deadline = time.monotonic() + seconds
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = {
            p
            for p in pids
            if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]
        }
    return alive


def test_a_killed_up_leaves_no_process_behind():
    # SIGKILL gives `torchfarm up` no chance to stop its farm: its redis-servers, gateway and
    # worker (each in a session of its own) must end with it all the same.
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchfarm", "up", "--grpc-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, TORCHFARM_TENANTS=f"alice:{hash_token(TOKENS['alice'])}"),
    )
    try:
        assert _operator_block(proc)["TORCHFARM_ADDR"]  # ready
        started = _descendants(proc.pid)
        assert len(_workers(started)) == 1 and len(started) >= 4, started
        proc.kill()
        proc.wait(timeout=30)
        alive = _alive_after(started, 30)
        assert not alive, f"left running: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
