"""An embedded farm as child processes: redis-server, the gateway and its workers.

What `torchfarm up`, the demo and the integration tests run. Every child lives in its own
process group, so stopping the farm also ends the compile children it started.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import redis

from torchfarm import signing
from torchfarm.cache.store import Store
from torchfarm.errors import FarmNotReady
from torchfarm.settings import env as settings_env

# util-linux's, on every Debian and Ubuntu; without it the farm's processes can outlive a
# killed parent, as before
_SETPRIV = shutil.which("setpriv")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalFarm:
    """Start with `with LocalFarm() as farm:`; `farm.addr` is host:port of the gateway.

    `tenants` / `admins` (name:sha256(token),...) default to TORCHFARM_TENANTS /
    TORCHFARM_ADMINS of the environment, never silently to an open farm. Its redis-servers
    listen on loopback only and require a password made for this farm, which reaches the
    gateway and workers through their environment (never their command line).
    """

    def __init__(
        self,
        grpc_port: int = 0,
        redis_port: int = 0,
        tenants: str | None = None,
        admins: str | None = None,
        sandbox: str = "bwrap",
        workers: int = 1,
        host: str = "127.0.0.1",
        log_dir: str | None = None,
        extra_env: dict | None = None,
        device: str = "cpu",
        tls: tuple[str, str] | None = None,
        insecure: bool = False,
        separate_broker: bool = False,
        gateways: int = 1,
        blob_url: str = "",
        cache_url: str = "",
    ):
        self.host, self.grpc_port, self.redis_port = host, grpc_port, redis_port
        # The cache on a Redis that runs already (a Redis Cluster: redis+cluster://...)
        # instead of a redis-server of the farm's own; the broker is then the farm's.
        self.cache_url = cache_url
        # A second redis-server for Celery and job state (as in docker-compose.yml); without
        # it they use database 1 of the cache's server.
        self.broker_port = 0 if separate_broker or cache_url else None
        self.tenants = settings_env.get("TENANTS") if tenants is None else tenants
        self.admins = settings_env.get("ADMINS") if admins is None else admins
        self.sandbox, self.workers = sandbox, workers
        # Gateways on one Redis (the first is `addr`): each a name and its port, kept across
        # a restart of that gateway.
        self.gateway_ports = {
            "gateway" if i == 0 else f"gateway{i}": grpc_port if i == 0 else 0
            for i in range(gateways)
        }
        self.redis_password = secrets.token_hex(16)
        self.device = device  # what the workers compile for: cpu or cuda
        self.tls = tls  # (certificate, key) PEM paths: the gateway serves TLS
        self.insecure = insecure  # plaintext beyond loopback (TORCHFARM_GATEWAY_INSECURE)
        self.workdir = tempfile.mkdtemp(prefix="torchfarm-up-")
        # Blobs: a content-addressed directory of the farm's own (cache/blobs.py) unless told
        # otherwise: every process of an embedded farm is on this host, so a directory keeps
        # large artifacts out of Redis with no server to start, and reads cost one file read.
        self.blob_url = (
            blob_url
            or settings_env.raw("BLOB_URL")
            or f"file://{os.path.join(self.workdir, 'blobs')}"
        )
        # Signing: the farm's own key, in its private workdir (0700); workers get the path,
        # the gateway (and through it, clients) the public key.
        self.signing_key = os.path.join(self.workdir, "signing.key")
        self.verify_keys = signing.generate(self.signing_key).public_key
        self.log_dir = log_dir or self.workdir
        self.extra_env = extra_env or {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.metrics_port = 0  # the gateway's Prometheus port, once started
        self.worker_metrics_ports: dict[str, int] = {}  # each worker's Prometheus port
        self.worker_names: set[str] = set()  # wait_ready waits for each one's canary
        self.worker_args: dict[str, tuple[str, dict | None]] = {}  # to start one again

    def _url(self, port: int | None) -> str:
        return f"redis://:{self.redis_password}@127.0.0.1:{port}/0"

    @property
    def redis_url(self) -> str:
        return self.cache_url or self._url(self.redis_port)

    @property
    def broker_url(self) -> str:
        return self._url(self.broker_port) if self.broker_port is not None else ""

    def store(self) -> Store:
        return Store.from_url(self.redis_url, self.broker_url, self.blob_url)

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def addrs(self) -> list[str]:
        """Every gateway's host:port, the first one's first."""
        return [f"{self.host}:{port}" for port in self.gateway_ports.values()]

    def __enter__(self) -> LocalFarm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        """Start one of the farm's processes in a session of its own, tied to this process's
        life: it gets SIGKILL when the thread that started it ends (util-linux `setpriv
        --pdeathsig`, kept across its exec), so a SIGKILLed `torchfarm up` or test leaves no
        redis-server, gateway or worker behind. Start a farm from a thread that outlives it."""
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        tied = [_SETPRIV, "--pdeathsig", "KILL", "--"] if _SETPRIV else []
        proc = subprocess.Popen(
            [*tied, *cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.extra_env, **(env or {})},
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def start(self, timeout_s: float = 300) -> None:
        if not self.cache_url:
            self.start_redis()
        if self.broker_port is not None:
            self.start_redis("broker")
        for name in self.gateway_ports:
            self.start_gateway(name)
        for i in range(self.workers):
            self.start_worker(f"worker{i}")
        self.wait_ready(timeout_s)

    def start_redis(self, name: str = "redis") -> None:
        """The cache's redis-server ("redis"), or the broker's ("broker"); a restart keeps
        its port and directory (AOF)."""
        server = shutil.which("redis-server")
        if not server:
            raise RuntimeError(
                "redis-server not found: run `make deps` (apt-get install redis-server)"
            )
        attr = "redis_port" if name == "redis" else "broker_port"
        port = getattr(self, attr) or free_port()
        setattr(self, attr, port)
        directory = os.path.join(self.workdir, name)
        os.makedirs(directory, exist_ok=True)
        config = os.path.join(directory, "redis.conf")  # the password, readable by us alone
        with open(os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(f"requirepass {self.redis_password}\n")
        self._spawn(
            name,
            [
                server,
                config,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                directory,
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--protected-mode",
                "yes",
            ],
        )
        client = redis.Redis(port=port, password=self.redis_password)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.procs[name].poll() is not None:
                    raise RuntimeError(f"redis-server did not start; see {self.log_dir}/{name}.log")
                time.sleep(0.05)

    def start_gateway(self, name: str = "gateway") -> None:
        """A gateway (again, on its port, when `name` ran before)."""
        port = self.gateway_ports.get(name) or free_port()
        self.gateway_ports[name] = port
        if name == "gateway":
            self.grpc_port = port
        metrics_port = free_port()
        if name == "gateway":
            self.metrics_port = metrics_port
        self._spawn(
            name,
            [
                sys.executable,
                "-m",
                "torchfarm",
                "gateway",
                "--host",
                self.host,
                "--port",
                str(port),
            ],
            env=settings_env.environ(
                REDIS_URL=self.redis_url,
                BLOB_URL=self.blob_url,
                TENANTS=self.tenants,
                ADMINS=self.admins,
                BROKER_URL=self.broker_url,
                METRICS_PORT=metrics_port,
                TLS_CERT=self.tls[0] if self.tls else "",
                TLS_KEY=self.tls[1] if self.tls else "",
                GATEWAY_INSECURE=self.insecure,
                VERIFY_KEYS=self.verify_keys,
            ),
        )

    def start_worker(
        self, name: str, device: str = "", env: dict | None = None
    ) -> subprocess.Popen:
        """One more worker, for the farm's device or for `device`; `env` adds to its
        environment (a worker of other settings)."""
        self.worker_names.add(name)
        self.worker_args[name] = (device, env)
        self.worker_metrics_ports[name] = free_port()
        return self._spawn(
            name,
            [
                sys.executable,
                "-m",
                "torchfarm",
                "worker",
                "--sandbox",
                self.sandbox,
                "--device",
                device or self.device,
            ],
            env={
                **settings_env.environ(
                    REDIS_URL=self.redis_url,
                    BLOB_URL=self.blob_url,
                    WORKER_METRICS_PORT=self.worker_metrics_ports[name],
                    BROKER_URL=self.broker_url,
                    SIGNING_KEY=self.signing_key,
                    # the tenants' kernels live and go with this farm, like its cache
                    KERNEL_CACHE=self.extra_env.get(settings_env.name("KERNEL_CACHE"))
                    or settings_env.raw("KERNEL_CACHE")
                    or os.path.join(self.workdir, "kernels"),
                ),
                **(env or {}),
            },
        )

    def restart_exited_workers(self) -> list[str]:
        """Start again, as it was started, each worker whose process exited (a crash, the
        kernel's OOM killer, an unrecoverable broker error): an embedded farm heals itself.
        Its queued jobs wait for it; the jobs it was running are taken over by their waiters
        once their heartbeat stops (cache/jobs.py)."""
        restarted = []
        for name in sorted(self.worker_names):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                device, env = self.worker_args[name]
                self.start_worker(name, device, env)
                restarted.append(f"{name} (exit status {proc.returncode})")
        return restarted

    def wait_ready(self, timeout_s: float) -> None:
        """Until every gateway answers health checks and every worker started has passed its
        canary compile; FarmNotReady with the reason (a worker's own error) otherwise."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        store = self.store()
        deadline = time.monotonic() + timeout_s
        credentials = None
        if self.tls:
            with open(self.tls[0], "rb") as f:
                credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        channels = [
            grpc.secure_channel(addr, credentials) if credentials else grpc.insecure_channel(addr)
            for addr in self.addrs
        ]

        def serving(channel: grpc.Channel) -> bool:
            try:
                status = (
                    health_pb2_grpc.HealthStub(channel)
                    .Check(health_pb2.HealthCheckRequest(), timeout=1)
                    .status
                )
            except grpc.RpcError:
                return False
            return status == health_pb2.HealthCheckResponse.SERVING

        rebound: dict[str, int] = {}
        try:
            while True:
                waiting = self._workers_not_ready(store)  # first: a failed one exits at once
                for name, proc in list(self.procs.items()):
                    if proc.poll() is not None:
                        if self._port_taken(name) and rebound.get(name, 0) < 3:
                            # Its metrics port, free when picked, was taken before it bound it
                            # (by any process of the host: farms started side by side, an
                            # outgoing connection's local port): again, on another.
                            rebound[name] = rebound.get(name, 0) + 1
                            if name in self.worker_names:
                                self.start_worker(name, *self.worker_args[name])
                            else:  # a gateway: its gRPC port kept, a new metrics port
                                self.start_gateway(name)
                            continue
                        raise FarmNotReady(
                            f"{name} exited ({proc.returncode}): {self._last_words(name)}"
                            f"; see {self.log_dir}/{name}.log"
                        )
                if all(serving(channel) for channel in channels) and not waiting:
                    return
                if time.monotonic() > deadline:
                    raise FarmNotReady(
                        f"farm not ready in {timeout_s:.0f} s (waiting for "
                        f"{', '.join(waiting) or 'the gateways'}); logs in {self.log_dir}"
                    )
                time.sleep(0.2)
        finally:
            for channel in channels:
                channel.close()

    def _workers_not_ready(self, store: Store) -> list[str]:
        """The workers started that have not passed their canary yet; FarmNotReady with the
        error of one whose canary failed."""
        found = {
            entry.pid: (pool, entry)
            for pool in store.pools.live().values()
            for entry in pool.workers.values()
        }
        waiting = []
        for name in sorted(self.worker_names & self.procs.keys()):
            pool, entry = found.get(self.procs[name].pid, (None, None))
            if pool is not None and entry is not None and entry.readiness.state == "failed":
                raise FarmNotReady(
                    f"{name}: pool {pool.name} cannot compile: {entry.readiness.error}"
                    f"\n(see {self.log_dir}/{name}.log)"
                )
            if entry is None or entry.readiness.state != "ready":
                waiting.append(name)
        return waiting

    def _port_taken(self, name: str) -> bool:
        known = name in self.worker_names or name in self.gateway_ports
        return known and "Errno 98" in self._last_words(name)

    def _last_words(self, name: str) -> str:
        """The last line of a process's log: why it exited, when it said so."""
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4096))
                lines = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1] if lines else ""

    def stop_process(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 15) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
        try:  # anything the process left in its group (compile children)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        for name in [n for n in self.procs if n not in ("redis", "broker")] + ["broker", "redis"]:
            self.stop_process(name)
        shutil.rmtree(self.workdir, ignore_errors=True)
