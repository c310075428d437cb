"""A real Redis Cluster for the tests: three masters from Debian's redis-server, on loopback
ports picked at run time, in a private directory, behind one password, joined with
`redis-cli --cluster create` as an operator would (no replicas: the tests need the slots
spread over masters, not failover)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import random
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import redis


@dataclasses.dataclass(frozen=True)
class RedisClusterServers:
    ports: tuple[int, ...]
    password: str

    @property
    def url(self) -> str:
        """TORCHFARM_REDIS_URL for the cluster: any one node of it."""
        return f"redis+cluster://:{self.password}@127.0.0.1:{self.ports[0]}"

    def node(self, port: int) -> redis.Redis:
        """A plain client of one node, to look into what it holds."""
        return redis.Redis(port=port, password=self.password, socket_timeout=5)

    def slot_owners(self) -> dict[int, int]:
        """Each master's port -> the number of keys it holds."""
        return {port: self.node(port).dbsize() for port in self.ports}


@contextlib.contextmanager
def redis_cluster(masters: int = 3, timeout_s: float = 30) -> Iterator[RedisClusterServers]:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        raise RuntimeError("redis-server not found: run `make deps` (apt-get install redis-server)")
    directory = tempfile.mkdtemp(prefix="redis-cluster-")
    password = secrets.token_hex(16)
    ports = _ports_with_bus(masters)
    procs = []
    try:
        for port in ports:
            node_dir = os.path.join(directory, str(port))
            os.makedirs(node_dir)
            config = os.path.join(node_dir, "redis.conf")
            with open(os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(f"requirepass {password}\nmasterauth {password}\n")
            log = open(os.path.join(node_dir, "redis.log"), "wb")
            procs.append(
                subprocess.Popen(
                    [
                        server,
                        config,
                        "--port",
                        str(port),
                        "--bind",
                        "127.0.0.1",
                        "--dir",
                        node_dir,
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "5000",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
            log.close()
        cluster = RedisClusterServers(ports, password)
        _wait(lambda: all(cluster.node(p).ping() for p in ports), timeout_s, directory)
        subprocess.run(
            [
                cli,
                "-a",
                password,
                "--no-auth-warning",
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=timeout_s,
        )
        _wait(
            lambda: all(cluster.node(p).cluster("info")["cluster_state"] == "ok" for p in ports),
            timeout_s,
            directory,
        )
        yield cluster
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(directory, ignore_errors=True)


def _ports_with_bus(count: int) -> tuple[int, ...]:
    """`count` free ports whose cluster bus ports (port + 10000) are free too: below the
    ephemeral range's top, where port + 10000 would pass 65535."""
    chosen: list[int] = []
    while len(chosen) < count:
        port = random.randrange(20000, 30000)
        if port in chosen:
            continue
        with contextlib.ExitStack() as bound:
            try:
                for p in (port, port + 10000):
                    sock = bound.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", p))
            except OSError:
                continue
        chosen.append(port)
    return tuple(chosen)


def _wait(ready, timeout_s: float, directory: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(redis.RedisError):
            if ready():
                return
        if time.monotonic() > deadline:
            logs = "".join(
                f"\n--- {path}:\n{path.read_text()[-1500:]}"
                for path in pathlib.Path(directory).glob("*/redis.log")
            )
            raise RuntimeError(f"the Redis Cluster did not come up:{logs}")
        time.sleep(0.1)
