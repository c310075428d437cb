"""One typed settings object per service, read from the TORCHFARM_* variables of the table
(settings/env.py: each variable's type, default and docs line); the worker's defaults that
depend on its host are worked out in settings/sizing.py."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchfarm.settings import env, sizing

if TYPE_CHECKING:  # typing.Self is Python 3.11's; the package supports 3.10
    from typing_extensions import Self


def _var(short: str) -> Any:
    """A field read from TORCHFARM_<short>, with the table's default."""
    return dataclasses.field(default=env.default(short), metadata={"env": short})


class _FromEnv:
    """A settings class read from its TORCHFARM_* variables (the mixin of each service's)."""

    @classmethod
    def from_env(cls, **overrides: Any) -> Self:
        """The settings from the environment; an override that is not None wins over its
        variable."""
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        values = {f.name: env.get(f.metadata["env"]) for f in fields if "env" in f.metadata}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _validate(settings: Any) -> None:
    """Each field's value checked by its variable's entry in the table."""
    for f in dataclasses.fields(settings):
        env.setting(f.metadata["env"]).validate(getattr(settings, f.name))


@dataclasses.dataclass(frozen=True)
class ClientSettings(_FromEnv):
    addr: str = _var("ADDR")
    token: str = _var("TOKEN")
    connect_timeout_s: float = _var("CONNECT_TIMEOUT")
    compile_timeout_s: float = _var("COMPILE_TIMEOUT")
    inactivity_timeout_s: float = _var("INACTIVITY_TIMEOUT")
    progress: bool = _var("PROGRESS")
    tls_ca: str = _var("TLS_CA")
    private: bool = _var("PRIVATE")
    verify_keys: str = _var("VERIFY_KEYS")
    parallel_graphs: int = _var("PARALLEL_GRAPHS")
    wait: bool = _var("WAIT")
    skip_tracing: bool | None = _var("SKIP_TRACING")  # None: dynamo_package.DEFAULT_ON decides
    package_key: str = _var("PACKAGE_KEY")


@dataclasses.dataclass(frozen=True)
class AdminSettings(_FromEnv):
    """`torchfarm cache`: the gateway's Admin service, with an operator's token."""

    addr: str = _var("ADDR")
    token: str = _var("ADMIN_TOKEN")
    tls_ca: str = _var("TLS_CA")
    timeout_s: float = _var("ADMIN_TIMEOUT")


def user_cache_dir() -> Path:
    """This user's torchfarm files on a client machine: $XDG_CACHE_HOME/torchfarm, else
    ~/.cache/torchfarm."""
    return Path(os.environ.get("XDG_CACHE_HOME", "") or Path.home() / ".cache") / "torchfarm"


def parse_tenants(spec: str, variable: str = env.name("TENANTS")) -> dict[str, str]:
    """`name:sha256hex,...` -> {sha256hex: name}. Tokens are stored only as hashes."""
    tenants = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, digest = item.partition(":")
        if len(digest) != 64:
            raise ValueError(f"{variable} entry {name!r}: expected name:<sha256 hex>")
        tenants[digest.lower()] = name
    return tenants


@dataclasses.dataclass(frozen=True)
class GatewaySettings(_FromEnv):
    host: str = _var("GATEWAY_HOST")
    port: int = _var("GATEWAY_PORT")
    redis_url: str = _var("REDIS_URL")
    broker_url: str = _var("BROKER_URL")
    blob_url: str = _var("BLOB_URL")
    tenants: str = _var("TENANTS")
    max_payload_bytes: int = _var("MAX_PAYLOAD_BYTES")
    compile_timeout_s: float = _var("GATEWAY_COMPILE_TIMEOUT")
    threads: int = _var("GATEWAY_THREADS")
    max_streams: int = _var("GATEWAY_MAX_STREAMS")  # 0: resolved here, from the threads
    tenant_max_streams: int = _var("TENANT_MAX_STREAMS")  # 0: as well
    message_timeout_s: float = _var("GATEWAY_MESSAGE_TIMEOUT")
    chunk_bytes: int = _var("CHUNK_BYTES")
    verified_mb: int = _var("GATEWAY_VERIFIED_MB")
    recheck_s: float = _var("GATEWAY_RECHECK_S")
    metrics_port: int = _var("METRICS_PORT")
    metrics_host: str = _var("METRICS_HOST")
    auth_failures: int = _var("AUTH_FAILURES")
    legacy_tokens: bool = _var("LEGACY_TOKENS")
    admins: str = _var("ADMINS")
    tenant_max_compiles: int = _var("TENANT_MAX_COMPILES")
    tenant_package_mb: int = _var("TENANT_PACKAGE_MB")
    tls_cert: str = _var("TLS_CERT")
    tls_key: str = _var("TLS_KEY")
    insecure: bool = _var("GATEWAY_INSECURE")
    verify_keys: str = _var("VERIFY_KEYS")

    def __post_init__(self) -> None:
        _validate(self)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TORCHFARM_TLS_CERT and TORCHFARM_TLS_KEY go together")
        # Frozen: the stream caps that default to shares of the threads are resolved here.
        if not self.max_streams:
            object.__setattr__(self, "max_streams", self.threads * 3 // 4)
        if not self.tenant_max_streams:
            object.__setattr__(self, "tenant_max_streams", max(1, self.threads // 4))
        if not 0 < self.max_streams < self.threads:
            raise ValueError(
                f"TORCHFARM_GATEWAY_MAX_STREAMS ({self.max_streams}) must leave threads for "
                f"short calls: at least 1, below TORCHFARM_GATEWAY_THREADS ({self.threads})"
            )
        if not 0 < self.tenant_max_streams <= self.max_streams:
            raise ValueError(
                f"TORCHFARM_TENANT_MAX_STREAMS ({self.tenant_max_streams}) must be at least 1 "
                f"and at most TORCHFARM_GATEWAY_MAX_STREAMS ({self.max_streams})"
            )

    @property
    def unauthenticated_streams(self) -> int:
        """Streams without a token (health Watch, reflection) open at once: a pool of their
        own beside the tenants' streams, a quarter of the threads those leave (at least 1)."""
        return max(1, (self.threads - self.max_streams) // 4)


@dataclasses.dataclass(frozen=True)
class WorkerSettings(_FromEnv):
    redis_url: str = _var("REDIS_URL")
    broker_url: str = _var("BROKER_URL")
    blob_url: str = _var("BLOB_URL")
    pool: str = _var("POOL")
    device: str = _var("DEVICE")
    concurrency: int = _var("WORKER_CONCURRENCY")  # 0: sizing.default_concurrency(device)
    warm_children: int = _var("WARM_CHILDREN")  # -1: as many as compiles at once
    warm_up_timeout_s: float = _var("WARM_UP_TIMEOUT")
    sandbox: str = _var("SANDBOX")
    compile_timeout_s: float = _var("COMPILE_TIMEOUT_WORKER")
    memory_limit_mb: int = _var("COMPILE_MEMORY_MB")  # -1: sizing.compile_memory_mb's, on CPU
    cache_max_bytes: int = _var("CACHE_MAX_BYTES")
    cache_ttl_s: float = _var("CACHE_TTL")
    redelivery_s: float = _var("REDELIVERY_TIMEOUT")  # 0: visibility_timeout_s
    metrics_port: int = _var("WORKER_METRICS_PORT")
    metrics_host: str = _var("WORKER_METRICS_HOST")
    op_libraries: str = _var("OP_LIBRARIES")
    compilers: str = _var("COMPILERS")
    failure_memory_s: float = _var("FAILURE_MEMORY")
    compile_disk_mb: int = _var("COMPILE_DISK_MB")  # 0: sizing.default_disk_mb's
    max_artifact_bytes: int = _var("MAX_ARTIFACT_BYTES")
    sandbox_binds: tuple[str, ...] = _var("SANDBOX_BINDS")
    signing_key: str = _var("SIGNING_KEY")
    insecure_unsigned: bool = _var("INSECURE_UNSIGNED")
    kernel_cache_mb: int = _var("KERNEL_CACHE_MB")
    kernel_cache_dir: str = _var("KERNEL_CACHE")
    kernel_builds: int = _var("KERNEL_BUILDS")  # 0: sizing.default_kernel_builds()
    kernel_build_priority: str = _var("KERNEL_BUILD_PRIORITY")
    spread_tuning: bool = _var("SPREAD_TUNING")
    concurrent_backward: str = _var("CONCURRENT_BACKWARD")
    kernel_names: str = _var("KERNEL_NAMES")

    def __post_init__(self) -> None:
        _validate(self)
        # Frozen: the defaults that depend on other fields are resolved once, here.
        if not self.concurrency:
            object.__setattr__(self, "concurrency", sizing.default_concurrency(self.device))
        if not self.kernel_builds:
            object.__setattr__(self, "kernel_builds", sizing.default_kernel_builds())
        if self.warm_children == -1:
            object.__setattr__(self, "warm_children", self.concurrency)
        processes = 2 if self.backward_helper else 1  # a child, and its helper
        share_mb = sizing.compile_share_mb(self.concurrency, self.warm_children * processes)
        if not self.compile_disk_mb:
            object.__setattr__(self, "compile_disk_mb", sizing.default_disk_mb(share_mb))
        if self.memory_limit_mb == -1 and self.device == "cuda":  # no cap applies on CUDA
            object.__setattr__(self, "memory_limit_mb", 0)
        elif self.memory_limit_mb == -1:
            object.__setattr__(
                self,
                "memory_limit_mb",
                sizing.compile_memory_mb(share_mb, self.compile_disk_mb, processes),
            )

    @property
    def backward_helper(self) -> bool:
        """Whether each compile child has a backward helper (TORCHFARM_CONCURRENT_BACKWARD)."""
        return self.concurrent_backward == "1" or (
            self.concurrent_backward == "auto" and self.device == "cuda"
        )

    @property
    def visibility_timeout_s(self) -> float:
        """Seconds an unacknowledged task stays with its worker before it is redelivered."""
        return self.redelivery_s or self.compile_timeout_s + 300


CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")  # the cache on a Redis Cluster


def is_cluster(url: str) -> bool:
    """Whether a Redis URL names a Redis (or Valkey) Cluster: redis+cluster://[:password@]
    host:port, any one node of it (rediss+cluster:// over TLS)."""
    return url.startswith(CLUSTER_SCHEMES)


def broker_url(redis_url: str, broker: str) -> str:
    """Celery's broker: given explicitly, or the cache's Redis server on database 1. A Redis
    Cluster holds the cache only: Celery's queues and the job board need one server."""
    if is_cluster(broker):
        raise ValueError(
            "TORCHFARM_BROKER_URL names a Redis Cluster: the broker (Celery's queues, the "
            "job board) needs a single Redis or Valkey server (redis://...)"
        )
    if broker:
        return broker
    if is_cluster(redis_url):
        raise ValueError(
            "the cache is on a Redis Cluster (TORCHFARM_REDIS_URL); set TORCHFARM_BROKER_URL "
            "to a single Redis or Valkey server for Celery's queues and the job board"
        )
    base, _, db = redis_url.rpartition("/")
    return f"{base}/1" if db.isdigit() else f"{redis_url.rstrip('/')}/1"
