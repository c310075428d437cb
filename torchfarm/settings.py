"""Every setting torchfarm reads from the environment, one typed object per service.

The README's configuration table lists the same variables; nothing else reads os.environ.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from torchfarm.compiler import compilers


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _flag(value: str) -> bool | None:
    """A yes/no variable that may be unset (None: the code's own default decides)."""
    return None if value == "" else value.lower() not in ("0", "false", "no")


@dataclasses.dataclass(frozen=True)
class ClientSettings:
    # TORCHFARM_ADDR host:port, or several gateways: ip:port,ip:port or a DNS name resolving to
    # them all (client/remote.py: round-robin, a lost gateway's calls made again on another);
    # empty = compile locally
    addr: str = ""
    token: str = ""  # TORCHFARM_TOKEN
    connect_timeout_s: float = 2.0  # TORCHFARM_CONNECT_TIMEOUT: time to decide the farm is down
    compile_timeout_s: float = 900.0  # TORCHFARM_COMPILE_TIMEOUT: longest wait for one graph
    # TORCHFARM_INACTIVITY_TIMEOUT: give up on a farm that sends nothing (no progress, no data)
    # this long, and compile locally; the gateway sends progress every second
    inactivity_timeout_s: float = 15.0
    progress: bool = True  # TORCHFARM_PROGRESS=0 turns the stderr progress line off
    # TORCHFARM_TLS_CA: PEM certificate(s) to trust for a TLS gateway; "system" = the system's
    # roots; empty = plaintext
    tls_ca: str = ""
    private: bool = False  # TORCHFARM_PRIVATE=1: entries only this tenant can hit
    # TORCHFARM_VERIFY_KEYS: the farm's entry-verification keys (comma-separated base64) this
    # client pins; empty = the keys the gateway serves (Farm.Info), asked once per process
    verify_keys: str = ""
    # TORCHFARM_PARALLEL_GRAPHS: static graphs fetched from the farm at once, in the background,
    # while Dynamo goes on (each is one gRPC stream); 0 = every graph blocks the backend
    parallel_graphs: int = 8
    # TORCHFARM_WAIT=0: on a miss, run the graph eagerly while the farm compiles it, then switch
    # to its compiled code between two calls (client/switching.py); a hit is served as with 1
    wait: bool = True
    # TORCHFARM_SKIP_TRACING=1 keeps Dynamo's output on the farm (per tenant) for a later
    # process to install instead of tracing (client/packages.py); needs a token. Unset (None):
    # on only for the torch releases whose third-party zoo passed with it
    # (dynamo_package.DEFAULT_ON); 0 turns it off everywhere
    skip_tracing: bool | None = None
    # TORCHFARM_REGIONS=1: a static graph of repeated blocks (a ModuleList's children) goes to
    # the farm as one graph per block, so blocks of one shape compile once, for this model and
    # its siblings (torch_adapter/regions.py); such a graph's Dynamo package is not kept
    regions: bool = False
    # TORCHFARM_PACKAGE_KEY: the secret (32+ characters) that authenticates this user's Dynamo
    # packages; it never leaves the client. Empty = a key file of this user's, made on first
    # use (user_cache_dir()/package.key, mode 0600). Give every machine of a job the same one.
    package_key: str = ""

    @classmethod
    def from_env(cls, **overrides) -> ClientSettings:
        values: dict[str, Any] = dict(
            addr=_env("TORCHFARM_ADDR", ""),
            token=_env("TORCHFARM_TOKEN", ""),
            connect_timeout_s=float(_env("TORCHFARM_CONNECT_TIMEOUT", "2")),
            tls_ca=_env("TORCHFARM_TLS_CA", ""),
            compile_timeout_s=float(_env("TORCHFARM_COMPILE_TIMEOUT", "900")),
            inactivity_timeout_s=float(_env("TORCHFARM_INACTIVITY_TIMEOUT", "15")),
            progress=_env("TORCHFARM_PROGRESS", "1") not in ("0", "false", "no"),
            private=_env("TORCHFARM_PRIVATE", "0") in ("1", "true", "yes"),
            verify_keys=_env("TORCHFARM_VERIFY_KEYS", ""),
            parallel_graphs=int(_env("TORCHFARM_PARALLEL_GRAPHS", "8")),
            wait=_env("TORCHFARM_WAIT", "1") not in ("0", "false", "no"),
            skip_tracing=_flag(_env("TORCHFARM_SKIP_TRACING", "")),
            regions=_env("TORCHFARM_REGIONS", "0") in ("1", "true", "yes"),
            package_key=_env("TORCHFARM_PACKAGE_KEY", ""),
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class AdminSettings:
    """`torchfarm cache`: the gateway's Admin service, with an operator's token."""

    addr: str = ""  # TORCHFARM_ADDR host:port of the gateway
    token: str = ""  # TORCHFARM_ADMIN_TOKEN: a token listed in the gateway's TORCHFARM_ADMINS
    tls_ca: str = ""  # TORCHFARM_TLS_CA, as for clients
    timeout_s: float = 600.0  # TORCHFARM_ADMIN_TIMEOUT: longest wait for one command

    @classmethod
    def from_env(cls, **overrides) -> AdminSettings:
        values: dict[str, Any] = dict(
            addr=_env("TORCHFARM_ADDR", ""),
            token=_env("TORCHFARM_ADMIN_TOKEN", ""),
            tls_ca=_env("TORCHFARM_TLS_CA", ""),
            timeout_s=float(_env("TORCHFARM_ADMIN_TIMEOUT", "600")),
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def user_cache_dir() -> Path:
    """This user's torchfarm files on a client machine: $XDG_CACHE_HOME/torchfarm, else
    ~/.cache/torchfarm."""
    return Path(_env("XDG_CACHE_HOME", "") or Path.home() / ".cache") / "torchfarm"


def parse_tenants(spec: str, variable: str = "TORCHFARM_TENANTS") -> dict[str, str]:
    """`name:sha256hex,...` -> {sha256hex: name}. Tokens are stored only as hashes."""
    tenants = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, digest = item.partition(":")
        if len(digest) != 64:
            raise ValueError(f"{variable} entry {name!r}: expected name:<sha256 hex>")
        tenants[digest.lower()] = name
    return tenants


@dataclasses.dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"  # TORCHFARM_GATEWAY_HOST
    port: int = 8470  # TORCHFARM_GATEWAY_PORT (0 = any free port)
    redis_url: str = "redis://127.0.0.1:6379/0"  # TORCHFARM_REDIS_URL
    broker_url: str = ""  # TORCHFARM_BROKER_URL (default: redis_url's db 1)
    # TORCHFARM_BLOB_URL: where artifact bytes live (cache/blobs.py): redis (the cache's Redis,
    # small farms), file:///dir, or s3://bucket[/prefix]?endpoint=URL&region=NAME (credentials:
    # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or any other source boto3 reads)
    blob_url: str = "redis"
    tenants: str = ""  # TORCHFARM_TENANTS tenant:sha256(token),...; empty = open farm
    max_payload_bytes: int = 64 << 20  # TORCHFARM_MAX_PAYLOAD_BYTES
    compile_timeout_s: float = 1800.0  # TORCHFARM_GATEWAY_COMPILE_TIMEOUT
    threads: int = 128  # TORCHFARM_GATEWAY_THREADS: concurrent RPCs
    # TORCHFARM_GATEWAY_MAX_STREAMS: Get/Compile streams open at once (each holds a thread
    # while it waits), the rest refused (RESOURCE_EXHAUSTED); 0 = three quarters of the
    # threads, so that short calls always find one
    max_streams: int = 0
    # TORCHFARM_TENANT_MAX_STREAMS: one tenant's streams open at once; 0 = a quarter of the
    # threads
    tenant_max_streams: int = 0
    # TORCHFARM_GATEWAY_MESSAGE_TIMEOUT: longest wait for a client's next message on a stream
    # (Get's ask, its payload after `missing`); past it the stream is cancelled
    message_timeout_s: float = 60.0
    chunk_bytes: int = 1 << 20  # TORCHFARM_CHUNK_BYTES
    verified_mb: int = 256  # TORCHFARM_GATEWAY_VERIFIED_MB: verified blobs kept (0 = none)
    # TORCHFARM_GATEWAY_RECHECK_S: a kept blob is served without reading the store for this
    # long after it was last compared with it (a corrupt or removed object is found after)
    recheck_s: float = 10.0
    metrics_port: int = 9470  # TORCHFARM_METRICS_PORT: Prometheus /metrics, 0 = off
    metrics_host: str = ""  # TORCHFARM_METRICS_HOST: /metrics listens here; "" = gateway host
    # TORCHFARM_AUTH_FAILURES: failed authentications a peer address may make at once, per
    # kind of token (made by `torchfarm token`, or legacy); then one more per second (a token
    # bucket; over it: RESOURCE_EXHAUSTED, yet a valid made token, or a legacy one on a
    # connection that proved it, is served: gateway/auth.py)
    auth_failures: int = 10
    # TORCHFARM_LEGACY_TOKENS=0: only tokens made by `torchfarm token` (a 256-bit secret)
    # authenticate; 1 = others too (each tenant using one is logged once)
    legacy_tokens: bool = True
    admins: str = ""  # TORCHFARM_ADMINS admin:sha256(token),...; empty = no admin RPCs
    # TORCHFARM_TENANT_MAX_COMPILES: a tenant's queued and running compiles (farm-wide), 0 = none;
    # 16 by default: one job of parallel graphs and several ranks fits, a flood does not
    tenant_max_compiles: int = 16
    # TORCHFARM_TENANT_PACKAGE_MB: the bytes of Dynamo packages one tenant may keep on the farm
    # (they count in the cache's byte budget too); past it PutPackage is RESOURCE_EXHAUSTED
    tenant_package_mb: int = 64
    tls_cert: str = ""  # TORCHFARM_TLS_CERT: PEM certificate chain; with _KEY = TLS
    tls_key: str = ""  # TORCHFARM_TLS_KEY: PEM private key
    # TORCHFARM_GATEWAY_INSECURE=1 (`--insecure`): listen in plaintext beyond loopback (behind
    # a proxy that terminates TLS); without it such a gateway refuses to start without TLS
    insecure: bool = False
    # TORCHFARM_VERIFY_KEYS: the public keys of the workers' signing keys (comma-separated
    # base64), served to clients by Farm.Info; only entries they verify are offered or served
    verify_keys: str = ""

    def __post_init__(self) -> None:
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
        if self.message_timeout_s <= 0:
            raise ValueError(
                "TORCHFARM_GATEWAY_MESSAGE_TIMEOUT must be positive, not "
                f"{self.message_timeout_s:g}"
            )

    @property
    def unauthenticated_streams(self) -> int:
        """Streams without a token (health Watch, reflection) open at once: a pool of their
        own beside the tenants' streams, a quarter of the threads those leave (at least 1)."""
        return max(1, (self.threads - self.max_streams) // 4)

    @classmethod
    def from_env(cls, **overrides) -> GatewaySettings:
        values: dict[str, Any] = dict(
            host=_env("TORCHFARM_GATEWAY_HOST", cls.host),
            port=int(_env("TORCHFARM_GATEWAY_PORT", str(cls.port))),
            redis_url=_env("TORCHFARM_REDIS_URL", cls.redis_url),
            broker_url=_env("TORCHFARM_BROKER_URL", ""),
            blob_url=_env("TORCHFARM_BLOB_URL", cls.blob_url),
            tenants=_env("TORCHFARM_TENANTS", ""),
            max_payload_bytes=int(_env("TORCHFARM_MAX_PAYLOAD_BYTES", str(cls.max_payload_bytes))),
            compile_timeout_s=float(_env("TORCHFARM_GATEWAY_COMPILE_TIMEOUT", "1800")),
            threads=int(_env("TORCHFARM_GATEWAY_THREADS", str(cls.threads))),
            max_streams=_whole("TORCHFARM_GATEWAY_MAX_STREAMS", "0"),
            tenant_max_streams=_whole("TORCHFARM_TENANT_MAX_STREAMS", "0"),
            message_timeout_s=float(_env("TORCHFARM_GATEWAY_MESSAGE_TIMEOUT", "60")),
            chunk_bytes=int(_env("TORCHFARM_CHUNK_BYTES", str(cls.chunk_bytes))),
            verified_mb=int(_env("TORCHFARM_GATEWAY_VERIFIED_MB", str(cls.verified_mb))),
            recheck_s=float(_env("TORCHFARM_GATEWAY_RECHECK_S", str(cls.recheck_s))),
            metrics_port=int(_env("TORCHFARM_METRICS_PORT", str(cls.metrics_port))),
            metrics_host=_env("TORCHFARM_METRICS_HOST", ""),
            auth_failures=int(_env("TORCHFARM_AUTH_FAILURES", str(cls.auth_failures))),
            admins=_env("TORCHFARM_ADMINS", ""),
            legacy_tokens=_env("TORCHFARM_LEGACY_TOKENS", "1") not in ("0", "false", "no"),
            tenant_max_compiles=_whole("TORCHFARM_TENANT_MAX_COMPILES", "16"),
            tenant_package_mb=_whole("TORCHFARM_TENANT_PACKAGE_MB", str(cls.tenant_package_mb)),
            tls_cert=_env("TORCHFARM_TLS_CERT", ""),
            tls_key=_env("TORCHFARM_TLS_KEY", ""),
            insecure=_env("TORCHFARM_GATEWAY_INSECURE", "0") in ("1", "true", "yes"),
            verify_keys=_env("TORCHFARM_VERIFY_KEYS", ""),
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    redis_url: str = "redis://127.0.0.1:6379/0"  # TORCHFARM_REDIS_URL
    broker_url: str = ""  # TORCHFARM_BROKER_URL
    # TORCHFARM_BLOB_URL: where artifact bytes live (cache/blobs.py): redis (the cache's Redis,
    # small farms), file:///dir, or s3://bucket[/prefix]?endpoint=URL&region=NAME (credentials:
    # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or any other source boto3 reads)
    blob_url: str = "redis"
    pool: str = "auto"  # TORCHFARM_POOL: "auto" = this machine's own target
    device: str = "cpu"  # TORCHFARM_DEVICE: cpu or cuda
    # TORCHFARM_WORKER_CONCURRENCY: compiles at once (threads of one worker process, each
    # driving its own sandboxed child); 0 = default_concurrency(device)
    concurrency: int = 0
    # TORCHFARM_WARM_CHILDREN: compile children kept started and warmed up ahead of need;
    # -1 = as many as compiles at once, 0 = start each child on demand
    warm_children: int = -1
    # TORCHFARM_WARM_UP_TIMEOUT: a child not ready this long after its start is killed and
    # replaced
    warm_up_timeout_s: float = 300
    sandbox: str = "bwrap"  # TORCHFARM_SANDBOX: bwrap, or none (insecure, loud warning)
    compile_timeout_s: float = 1800.0  # TORCHFARM_COMPILE_TIMEOUT_WORKER: wall clock per compile
    # TORCHFARM_COMPILE_MEMORY_MB: address-space limit of a CPU compile child, 0 = none;
    # -1 = the default: the host's memory shared among the children that can run at once
    # (compile_memory_mb). Not applied on CUDA (see docs/self-hosting.md).
    memory_limit_mb: int = -1
    cache_max_bytes: int = 10 << 30  # TORCHFARM_CACHE_MAX_BYTES: stored-blob budget (LRU), 0 = none
    cache_ttl_s: float = 0  # TORCHFARM_CACHE_TTL: drop entries unused this long, 0 = never
    # TORCHFARM_REDELIVERY_TIMEOUT: the broker's visibility timeout: an unacknowledged task
    # goes back to its queue this long after it was taken; 0 = compile timeout + 300 s. A
    # compile may outlive it: the copy finds the job's lease held by the live run and ends
    # without compiling (cache/jobs.py); a dead worker's job is taken over by its waiters
    # once its lease lapses (15 s), whatever this is.
    redelivery_s: float = 0
    metrics_port: int = 0  # TORCHFARM_WORKER_METRICS_PORT: Prometheus /metrics, 0 = off
    metrics_host: str = "127.0.0.1"  # TORCHFARM_WORKER_METRICS_HOST: where /metrics listens
    # TORCHFARM_OP_LIBRARIES: comma-separated modules the compile child imports first, so that
    # graphs may call the custom operators they register (e.g. transformers.integrations.moe)
    op_libraries: str = ""
    # TORCHFARM_COMPILERS: the compilers this pool runs (compiler/compilers.py): built-ins by
    # name (inductor, aoti), others as name=module:Class importable in the compile child
    compilers: str = compilers.DEFAULT
    # TORCHFARM_FAILURE_MEMORY: a job whose compile raised (not a timeout or a killed child) is
    # answered with that error, without compiling again, for this long; 0 = always retry
    failure_memory_s: float = 600
    # TORCHFARM_COMPILE_DISK_MB: size of the compile child's private work dir (a tmpfs in its
    # sandbox: counts against the machine's memory, vanishes with the child); 0 = the default,
    # 4 GiB or a quarter of a compile's share of the host's memory if less
    compile_disk_mb: int = 0
    # TORCHFARM_MAX_ARTIFACT_BYTES: the largest artifact a compile child may hand back
    max_artifact_bytes: int = 1 << 30
    # TORCHFARM_SANDBOX_BINDS: comma-separated extra paths bound read-only into the sandbox,
    # for a toolchain outside /usr and the Python environment (e.g. /opt/cuda)
    sandbox_binds: tuple[str, ...] = ()
    # TORCHFARM_SIGNING_KEY: the farm's entry-signing key (a PEM file, `torchfarm keygen`),
    # read by the worker's parent only, never by a compile child; a worker without one
    # refuses to start unless TORCHFARM_INSECURE_UNSIGNED=1
    signing_key: str = ""
    # TORCHFARM_INSECURE_UNSIGNED=1: store entries unsigned (no client will load them)
    insecure_unsigned: bool = False
    # TORCHFARM_KERNEL_CACHE_MB: bytes of built C++ kernels kept per pool (built by the pool
    # from shared compiles' sources, for every compile; workers/kernel_builder.py) and per
    # (pool, tenant) (for that tenant's later private compiles; workers/kernel_cache.py),
    # oldest used pruned first; 0 = off
    kernel_cache_mb: int = 2048
    # TORCHFARM_KERNEL_CACHE: where those kernels live; "" = ~/.cache/torchfarm/kernels
    kernel_cache_dir: str = ""
    # TORCHFARM_SPREAD_TUNING=1: on a worker with several GPUs, one compile's max-autotune
    # candidates are benchmarked on all of them at once (torch_adapter/tuning_devices.py).
    # Off by default: on the bench GPT it made a 2-GPU worker's miss no faster
    # (docs/benchmarks.md, "Two GPUs"); each compile benchmarks on its own GPU
    spread_tuning: bool = False
    # TORCHFARM_CONCURRENT_BACKWARD: a training graph's backward compiled in a second process
    # of the compile's sandbox while the child compiles the forward
    # (torch_adapter/concurrent_backward.py): 1, 0, or auto = on where the host has at least
    # CONCURRENT_BACKWARD_MIN_CORES cores and, on CPU, the memory for a second process per
    # compile (the helper traces the graph again; a CPU compile's memory cap is split in two)
    concurrent_backward: str = "auto"
    # TORCHFARM_KERNEL_NAMES: how compile children name Triton kernels. "unique" (Inductor's
    # default): by what they fuse and their position in the graph (triton_poi_fused_add_3), so
    # the same kernel elsewhere in a sibling model is another kernel to Triton's cache and to
    # its tuning results. "content": every kernel `triton_` (Inductor's unique_kernel_names off),
    # so those follow the kernel's text alone; GPU profiles then show `triton_` for each kernel
    # (the descriptive name stays in Inductor's own profiler events).
    kernel_names: str = "unique"

    def __post_init__(self) -> None:
        if self.kernel_names not in ("unique", "content"):
            raise ValueError(
                f"TORCHFARM_KERNEL_NAMES must be unique or content, not {self.kernel_names!r}"
            )
        if self.concurrent_backward not in ("auto", "1", "0"):
            raise ValueError(
                "TORCHFARM_CONCURRENT_BACKWARD must be auto, 1 or 0, not "
                f"{self.concurrent_backward!r}"
            )
        if self.concurrency < 0:
            raise ValueError(
                f"TORCHFARM_WORKER_CONCURRENCY must be at least 1 (0 = default), not "
                f"{self.concurrency}"
            )
        if self.warm_children < -1:
            raise ValueError(
                f"TORCHFARM_WARM_CHILDREN must be at least 0 (-1 = as many as compiles at "
                f"once), not {self.warm_children}"
            )
        if self.warm_up_timeout_s <= 0:
            raise ValueError(
                f"TORCHFARM_WARM_UP_TIMEOUT must be positive, not {self.warm_up_timeout_s:g}"
            )
        if self.kernel_cache_mb < 0:
            raise ValueError(
                f"TORCHFARM_KERNEL_CACHE_MB must be at least 0 (0 = off), not "
                f"{self.kernel_cache_mb}"
            )
        # Frozen: the defaults that depend on other fields are resolved once, here.
        if not self.concurrency:
            object.__setattr__(self, "concurrency", default_concurrency(self.device))
        if self.warm_children == -1:
            object.__setattr__(self, "warm_children", self.concurrency)
        if self.concurrent_backward == "auto":
            on = (os.cpu_count() or 1) >= CONCURRENT_BACKWARD_MIN_CORES and (
                self.device == "cuda" or self._helper_fits()
            )
            object.__setattr__(self, "concurrent_backward", "1" if on else "0")
        processes = 2 if self.concurrent_backward == "1" else 1  # a child, and its helper
        share_mb = compile_share_mb(self.concurrency, self.warm_children * processes)
        if not self.compile_disk_mb:
            object.__setattr__(self, "compile_disk_mb", default_disk_mb(share_mb))
        if self.memory_limit_mb == -1 and self.device == "cuda":  # no cap applies on CUDA
            object.__setattr__(self, "memory_limit_mb", 0)
        elif self.memory_limit_mb == -1:
            object.__setattr__(
                self,
                "memory_limit_mb",
                compile_memory_mb(share_mb, self.compile_disk_mb, processes),
            )
        if self.redelivery_s < 0:
            raise ValueError(
                f"TORCHFARM_REDELIVERY_TIMEOUT must be positive (0 = the default), not "
                f"{self.redelivery_s:g}"
            )

    def _helper_fits(self) -> bool:
        """Whether a CPU compile's default memory cap, split with a helper, still holds a
        compile (an operator's own cap is taken as given)."""
        if self.memory_limit_mb != -1:
            return True
        share_mb = compile_share_mb(self.concurrency, 2 * self.warm_children)
        disk_mb = self.compile_disk_mb or default_disk_mb(share_mb)
        return memory_cap_mb(share_mb, disk_mb, 2) >= MIN_COMPILE_MEMORY_MB

    @property
    def visibility_timeout_s(self) -> float:
        """Seconds an unacknowledged task stays with its worker before it is redelivered."""
        return self.redelivery_s or self.compile_timeout_s + 300

    @classmethod
    def from_env(cls, **overrides) -> WorkerSettings:
        values: dict[str, Any] = dict(
            redis_url=_env("TORCHFARM_REDIS_URL", cls.redis_url),
            broker_url=_env("TORCHFARM_BROKER_URL", ""),
            blob_url=_env("TORCHFARM_BLOB_URL", cls.blob_url),
            pool=_env("TORCHFARM_POOL", "auto"),
            device=_env("TORCHFARM_DEVICE", "cpu"),
            concurrency=_whole("TORCHFARM_WORKER_CONCURRENCY", "0"),
            warm_children=_whole("TORCHFARM_WARM_CHILDREN", "-1"),
            warm_up_timeout_s=float(_env("TORCHFARM_WARM_UP_TIMEOUT", "300")),
            sandbox=_env("TORCHFARM_SANDBOX", "bwrap"),
            compile_timeout_s=float(_env("TORCHFARM_COMPILE_TIMEOUT_WORKER", "1800")),
            memory_limit_mb=int(_env("TORCHFARM_COMPILE_MEMORY_MB", "") or -1),
            cache_max_bytes=int(_env("TORCHFARM_CACHE_MAX_BYTES", str(cls.cache_max_bytes))),
            cache_ttl_s=float(_env("TORCHFARM_CACHE_TTL", "0")),
            redelivery_s=float(_env("TORCHFARM_REDELIVERY_TIMEOUT", "0")),
            metrics_port=int(_env("TORCHFARM_WORKER_METRICS_PORT", "0")),
            metrics_host=_env("TORCHFARM_WORKER_METRICS_HOST", cls.metrics_host),
            op_libraries=_env("TORCHFARM_OP_LIBRARIES", ""),
            compilers=_env("TORCHFARM_COMPILERS", cls.compilers),
            failure_memory_s=float(_env("TORCHFARM_FAILURE_MEMORY", "600")),
            compile_disk_mb=_whole("TORCHFARM_COMPILE_DISK_MB", "0"),
            max_artifact_bytes=int(
                _env("TORCHFARM_MAX_ARTIFACT_BYTES", str(cls.max_artifact_bytes))
            ),
            sandbox_binds=tuple(
                p.strip() for p in _env("TORCHFARM_SANDBOX_BINDS", "").split(",") if p.strip()
            ),
            signing_key=_env("TORCHFARM_SIGNING_KEY", ""),
            insecure_unsigned=_env("TORCHFARM_INSECURE_UNSIGNED", "0") in ("1", "true", "yes"),
            kernel_cache_mb=_whole("TORCHFARM_KERNEL_CACHE_MB", str(cls.kernel_cache_mb)),
            kernel_cache_dir=_env("TORCHFARM_KERNEL_CACHE", ""),
            spread_tuning=_env("TORCHFARM_SPREAD_TUNING", "0") in ("1", "true", "yes"),
            concurrent_backward=_env("TORCHFARM_CONCURRENT_BACKWARD", "auto").strip() or "auto",
            kernel_names=_env("TORCHFARM_KERNEL_NAMES", "unique").strip() or "unique",
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _whole(name: str, default: str) -> int:
    value = _env(name, default).strip() or default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, not {value!r}") from None


def visible_gpus() -> tuple[str, ...]:
    """The GPUs this worker may use, as CUDA_VISIBLE_DEVICES names them; without it, CUDA's
    ordinals of the /dev/nvidiaN nodes (a container may see /dev/nvidia3 alone, as ordinal 0)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return tuple(g.strip() for g in listed.split(",") if g.strip())
    try:
        nodes = os.listdir("/dev")
    except OSError:
        return ()
    count = sum(1 for n in nodes if n.startswith("nvidia") and n[6:].isdigit())
    return tuple(str(i) for i in range(count))


def default_concurrency(device: str) -> int:
    """Compiles at once by default: on CPU a quarter of the cores (each compile runs
    Inductor's parallel compile and the C++ compiler on several), at least 2 and at most 8;
    on CUDA two per visible GPU (one autotunes while another lowers), or the CPU figure where
    it is more: a graph split into regions (client/backend.py) arrives as several compiles at
    once, each of them mostly host work."""
    cpu = max(2, min(8, (os.cpu_count() or 1) // 4))
    if device == "cuda":
        return max(2 * len(visible_gpus()), cpu)
    return cpu


CONCURRENT_BACKWARD_MIN_CORES = 8  # TORCHFARM_CONCURRENT_BACKWARD=auto turns it on from here
COMPILE_SHM_MB = 256  # /dev/shm in a compile child's sandbox (a tmpfs: host memory)
WARM_CHILD_MB = 1024  # an idle warm child (torch and Inductor imported: ~340 MiB resident)


def host_memory_mb() -> int:
    """This machine's memory, or its cgroup's limit where lower (a container's)."""
    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value.isdigit():
            limit = min(limit, int(value) >> 20)
    return limit


def compile_share_mb(concurrency: int, warm_children: int) -> int:
    """One running compile's share of the host's memory (MiB): what is left after an eighth
    (at least 1 GiB) for the worker, Redis and the system, and WARM_CHILD_MB for each warm
    child that waits while `concurrency` compiles run, split among those compiles. A compile's
    share holds its address space, its RAM-backed work dir and its /dev/shm (docs/reliability.md,
    "Memory arithmetic")."""
    host = host_memory_mb()
    free = host - max(1024, host // 8) - warm_children * WARM_CHILD_MB
    return max(0, free // concurrency)


def default_disk_mb(share_mb: int) -> int:
    """A compile's RAM-backed work dir by default: a quarter of its share, 256 MiB to 4 GiB."""
    return max(256, min(4096, share_mb // 4))


def memory_cap_mb(share_mb: int, disk_mb: int, processes: int = 1) -> int:
    """A compile's share less its work dir and /dev/shm, split among the compile's
    `processes` (the child, and its backward helper where on), at most 32 GiB."""
    return min(32 << 10, (share_mb - disk_mb - COMPILE_SHM_MB) // processes)


def compile_memory_mb(share_mb: int, disk_mb: int, processes: int = 1) -> int:
    """A compile child's default address-space cap (memory_cap_mb); a host too small for
    its concurrency gets a clear error."""
    cap = memory_cap_mb(share_mb, disk_mb, processes)
    if cap < MIN_COMPILE_MEMORY_MB:
        raise ValueError(
            f"this host's memory ({host_memory_mb()} MiB) leaves a compile {share_mb} MiB: "
            f"lower TORCHFARM_WORKER_CONCURRENCY or TORCHFARM_WARM_CHILDREN, or set "
            f"TORCHFARM_COMPILE_MEMORY_MB and TORCHFARM_COMPILE_DISK_MB yourself"
        )
    return cap


MIN_COMPILE_MEMORY_MB = 2048  # below this a CPU compile child cannot even start Inductor


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
