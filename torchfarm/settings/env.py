"""Every TORCHFARM_* variable, defined once: its type, default, owner and docs line (the way
Celery's app/defaults.py defines its options). The README's configuration table is generated
from it (`python -m torchfarm.settings --markdown`), and every read of these variables goes
through `get` here: nothing else in torchfarm reads or writes them in os.environ (a unit test
checks), except to hand them to a child process (`environ`, `export`).

Unset or blank, a variable has its default. Yes/no variables take 1/true/yes and 0/false/no.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

PREFIX = "TORCHFARM_"
TRUE, FALSE = ("1", "true", "yes"), ("0", "false", "no")


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    type: type  # str, int, float, bool (a default of None: unset decides), tuple (a, b, ...)
    default: Any
    owner: str  # who reads it: client, gateway, worker, `cache` (the operator's CLI), internal
    doc: str
    shown: str = ""  # the README's default where the value alone does not say it
    choices: tuple[str, ...] = ()
    check: Callable[[Any], bool] | None = None  # with `must`: what a valid value must be
    must: str = ""

    def parse(self, text: str) -> Any:
        """The value of the variable set to `text` (blank: the default). A string is taken
        as it is (a token or a key may hold any character), a choice without spaces."""
        if not text.strip():
            return self.default
        if self.type is bool:
            word = text.strip().lower()
            return word in TRUE if self.default is False else word not in FALSE
        if self.type is tuple:
            return tuple(p.strip() for p in text.split(",") if p.strip())
        if self.type in (int, float):
            try:
                return self.type(text)
            except ValueError:
                kind = "a whole number" if self.type is int else "a number"
                raise ValueError(f"{self.name} must be {kind}, not {text.strip()!r}") from None
        return text.strip() if self.choices else text

    def validate(self, value: Any) -> None:
        """One message per setting for a value it does not take."""
        if self.choices and value not in self.choices:
            *first, last = self.choices
            self._refuse(f"{', '.join(first)} or {last}", value)
        if self.check is not None and not self.check(value):
            self._refuse(self.must, value)

    def _refuse(self, must: str, value: Any) -> None:
        raise ValueError(f"{self.name} must be {must}, not {self._shown(value)}")

    @staticmethod
    def _shown(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:g}"
        return str(value) if type(value) is int else repr(value)

    def text(self, value: Any) -> str:
        """`value` as this variable would be set to it."""
        if self.type is bool:
            return "" if value is None else "1" if value else "0"
        if self.type is tuple:
            return ",".join(value)
        if isinstance(value, float) and value.is_integer():
            return str(int(value))
        return str(value)

    def row(self) -> str:
        cells = (f"`{self.name}`", self.owner, self.shown or self.text(self.default), self.doc)
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "TORCHFARM_ADDR",
        str,
        "",
        "client, `cache`",
        "gateway `host:port`; several gateways: `ip:port,ip:port` or a DNS name resolving to all "
        "of them (`dns:///name:port`), balanced round-robin, a call whose gateway dies made again"
        " on another (docs/self-hosting.md)",
        shown="(unset: compile locally)",
    ),
    Setting(
        "TORCHFARM_ADMIN_TOKEN",
        str,
        "",
        "`cache`",
        "an admin token (in the gateway's `TORCHFARM_ADMINS`), sent as `authorization: Bearer` on"
        " the `Admin` RPCs",
    ),
    Setting(
        "TORCHFARM_ADMIN_TIMEOUT",
        float,
        600.0,
        "`cache`",
        "longest wait for one `torchfarm cache` command, seconds",
    ),
    Setting(
        "TORCHFARM_TOKEN",
        str,
        "",
        "client",
        "tenant token, sent as `authorization: Bearer`",
    ),
    Setting(
        "TORCHFARM_CONNECT_TIMEOUT",
        float,
        2.0,
        "client",
        "seconds to decide the farm is unreachable",
    ),
    Setting(
        "TORCHFARM_COMPILE_TIMEOUT",
        float,
        900.0,
        "client",
        "longest wait for one graph, seconds",
    ),
    Setting(
        "TORCHFARM_INACTIVITY_TIMEOUT",
        float,
        15.0,
        "client",
        "seconds a farm may send nothing (no progress, no data; the gateway sends progress every "
        "second) before the client gives up and compiles locally; a hung gateway costs a step "
        "this much",
    ),
    Setting(
        "TORCHFARM_PROGRESS",
        bool,
        True,
        "client",
        "0 turns the stderr progress line off",
    ),
    Setting(
        "TORCHFARM_TLS_CA",
        str,
        "",
        "client, `cache`",
        "PEM certificate(s) to trust for a TLS gateway, or `system` for the system roots",
        shown="(unset: plaintext)",
    ),
    Setting(
        "TORCHFARM_ALLOW_UNVERIFIED_TORCH",
        bool,
        False,
        "client, worker",
        "1: use the farm on a torch release the adapter was not verified on "
        "(`torchfarm/torch_adapter/gate.py`), with a loud warning; otherwise the client compiles "
        "locally and the worker does not start",
    ),
    Setting(
        "TORCHFARM_VERIFY_KEYS",
        str,
        "",
        "client, gateway, `cache import`",
        "comma-separated base64 Ed25519 public keys whose entry signatures are trusted. Gateway: "
        "served to clients (`Farm.Info`); without it, clients that pin no key load nothing from "
        "the farm. Client: pins the keys instead of asking the gateway. `cache import`: the "
        "default `--trust-key`",
        shown="(client: the gateway's)",
    ),
    Setting(
        "TORCHFARM_PRIVATE",
        bool,
        False,
        "client",
        "1: this tenant's entries only (keyed to the tenant by the gateway); no other tenant can "
        "hit them or see that they exist. Its misses reuse the C++ kernels of the tenant's "
        "earlier private compiles on the worker, and the pool's (`TORCHFARM_KERNEL_CACHE_MB`), "
        "and on a GPU pool the tenant's Triton kernels and autotune results; its kernels never "
        "enter the pool's",
    ),
    Setting(
        "TORCHFARM_PARALLEL_GRAPHS",
        int,
        8,
        "client",
        "static graphs (no symbolic shape) fetched from the farm at once in the background while "
        "Dynamo goes on, e.g. DDPOptimizer's buckets; each first call waits for its graph. 0: "
        "every graph blocks the backend, one after another",
    ),
    Setting(
        "TORCHFARM_WAIT",
        bool,
        True,
        "client",
        "0: never wait for a compile (or `torchfarm.compile(wait=False)`). A graph the farm does "
        "not serve at once (it says it compiles, or says nothing within 1 s) runs eagerly while "
        "the farm compiles it, and switches to the compiled code between two calls once it "
        "arrived; sizes outside its shape guards keep running eagerly. A hit is served as with 1."
        " A failing farm leaves the graph eager (one warning, no local compile). `history` and "
        "the log show eager-while-compiling, the switch and the calls that ran eagerly "
        '(docs/architecture.md, "Never wait")',
    ),
    Setting(
        "TORCHFARM_SKIP_TRACING",
        bool,
        None,
        "client",
        "1 turns it on, 0 off. Unset, it is on only for the releases in "
        "`dynamo_package.DEFAULT_ON`, those whose third-party zoo passed with it in a training "
        "loop. On: `torchfarm.compile(fn or module)` and `torch.compile(fn or module, "
        'backend="torchfarm")` keep Dynamo\'s output (guards, bytecode) on the farm, per tenant '
        "and HMAC'd with a key of `TORCHFARM_PACKAGE_KEY`'s and the token's;"
        " a later process installs it and traces no frame it can restore (docs/architecture.md, "
        '"Skipping Dynamo on a hit"). Needs `TORCHFARM_TOKEN` and a torch release in '
        "`dynamo_package.VERIFIED`",
        shown="(per release: on for 2.11 and 2.13, off elsewhere)",
    ),
    Setting(
        "TORCHFARM_PACKAGE_KEY",
        str,
        "",
        "client",
        "the secret (32+ characters) that authenticates this user's Dynamo packages "
        "(`TORCHFARM_SKIP_TRACING`); it never leaves the client, so neither the farm nor whoever "
        "saw a token can make the client unpickle a package. Unset: "
        "`$XDG_CACHE_HOME/torchfarm/package.key` (else `~/.cache/...`), 64 random hex digits made"
        " mode 0600 on first use and refused if others can read it. A package is restorable only "
        "where its secret is: give every rank and machine of a job the same value (e.g. that "
        "file's content); a machine with another secret traces and saves its own",
        shown="(a key file)",
    ),
    Setting(
        "TORCHFARM_GATEWAY_HOST",
        str,
        "127.0.0.1",
        "gateway",
        "listen address",
    ),
    Setting(
        "TORCHFARM_GATEWAY_PORT",
        int,
        8470,
        "gateway",
        "listen port (0: any free port)",
    ),
    Setting(
        "TORCHFARM_REDIS_URL",
        str,
        "redis://127.0.0.1:6379/0",
        "gateway, worker, `cache --direct`",
        "the cache; `redis+cluster://[:password@]host:port` (any node) for a Redis or Valkey "
        "Cluster, which then needs `TORCHFARM_BROKER_URL` (docs/cache.md)",
    ),
    Setting(
        "TORCHFARM_BROKER_URL",
        str,
        "",
        "gateway, worker",
        "Celery broker and job state, on one Redis or Valkey server (not a cluster); a server of "
        "its own keeps the farm compiling when the cache's Redis is full",
        shown="the cache server, db 1",
    ),
    Setting(
        "TORCHFARM_BLOB_URL",
        str,
        "redis",
        "gateway, worker, `torchfarm cache`",
        "where artifact bytes live (`cache/blobs.py`); Redis then keeps only the index, a few KB "
        "per entry. `redis`: the cache's Redis (small farms); `file:///dir`: a directory every "
        "gateway and worker sees; `s3://bucket[/prefix]?endpoint=URL&region=NAME`: an "
        "S3-compatible store (AWS S3 without `endpoint`; SeaweedFS, MinIO...), credentials from "
        "`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` or any other source boto3 reads; a worker "
        "makes the bucket if it is missing, refuses to start if the store is unreachable, and "
        "records which store it is; the gateway and `torchfarm cache` refuse to run pointed at "
        "another",
        shown="redis (`torchfarm up`: a directory of its own)",
    ),
    Setting(
        "TORCHFARM_TENANTS",
        str,
        "",
        "gateway",
        "`tenant:sha256(token),...`; `torchfarm token NAME` makes a strong token and prints its "
        "entry",
        shown="(unset: open farm)",
    ),
    Setting(
        "TORCHFARM_ADMINS",
        str,
        "",
        "gateway",
        "`name:sha256(token),...` allowed to call the `Admin` service (`torchfarm cache`: "
        "`Stats`, `List`, `Show`, `Drop`, `Purge`, `Export`, `Import`); a tenant token gets "
        "PERMISSION_DENIED",
        shown="(unset: no admin RPCs)",
    ),
    Setting(
        "TORCHFARM_MAX_PAYLOAD_BYTES",
        int,
        64 << 20,
        "gateway",
        "larger graphs get RESOURCE_EXHAUSTED",
    ),
    Setting(
        "TORCHFARM_GATEWAY_COMPILE_TIMEOUT",
        float,
        1800.0,
        "gateway",
        "DEADLINE_EXCEEDED after this",
    ),
    Setting(
        "TORCHFARM_GATEWAY_THREADS",
        int,
        128,
        "gateway",
        "concurrent RPCs (gRPC's sync server: a thread each, for its whole life)",
    ),
    Setting(
        "TORCHFARM_GATEWAY_MAX_STREAMS",
        int,
        0,
        "gateway",
        "tenants' `Get`/`Compile` streams open at once (each holds a thread while it waits for a "
        "message, a compile or a slow reader); past it RESOURCE_EXHAUSTED at once, and the client"
        " compiles locally at once. The last ⅛ of a tenant's share of them (at least 1) is kept "
        "for tenants holding no stream, so a tenant's first stream finds one. Must stay below the"
        " threads: the rest serve short calls (`Lookup`, `Info`, packages, refusals) and streams "
        "without a token (health `Watch`, reflection: a pool of their own, ¼ of the threads left,"
        " at least 1)",
        shown="0 (¾ of the threads)",
    ),
    Setting(
        "TORCHFARM_TENANT_MAX_STREAMS",
        int,
        0,
        "gateway",
        "streams one tenant may have open at once (an open farm is one tenant); past it "
        "RESOURCE_EXHAUSTED at once, and the client asks again (its own streams will free)",
        shown="0 (¼ of the threads)",
    ),
    Setting(
        "TORCHFARM_GATEWAY_MESSAGE_TIMEOUT",
        float,
        60.0,
        "gateway",
        "seconds the gateway waits for a stream's next message (`Get`'s ask; its payload after "
        "`missing`); past it the stream is cancelled (CANCELLED) and its thread freed",
        check=lambda v: v > 0,
        must="positive",
    ),
    Setting(
        "TORCHFARM_TENANT_PACKAGE_MB",
        int,
        64,
        "gateway",
        "bytes of Dynamo packages (the skip's) one tenant may keep on the farm, each at most 8 "
        "MiB; they count in the cache's byte budget; past it PutPackage gets RESOURCE_EXHAUSTED "
        "and the next process traces",
    ),
    Setting(
        "TORCHFARM_TENANT_MAX_COMPILES",
        int,
        16,
        "gateway",
        "compiles one tenant may have queued or running at once, farm-wide (counted on the "
        "broker's Redis until each job ends; a cancelled request's job still counts while "
        "queued); one more gets RESOURCE_EXHAUSTED; hits never wait",
        shown="16 (0: none)",
    ),
    Setting(
        "TORCHFARM_AUTH_FAILURES",
        int,
        10,
        "gateway",
        "failed authentications one peer address may make at once per kind of token (made by "
        "`torchfarm token`, or legacy), then one per second, never counted against a token id; "
        "over it RESOURCE_EXHAUSTED, yet a valid made token is served, and a legacy one on a "
        "connection that proved it (a new connection's legacy token is refused before it is "
        "compared); tenant and admin tokens alike; a call without a token spends nothing; 0 = no "
        "limit",
    ),
    Setting(
        "TORCHFARM_LEGACY_TOKENS",
        bool,
        True,
        "gateway",
        "0: only tokens made by `torchfarm token` (`tf_<id>_<secret>`, 256-bit secret) "
        "authenticate; 1: other tokens too, each tenant using one logged once",
    ),
    Setting(
        "TORCHFARM_CHUNK_BYTES",
        int,
        1 << 20,
        "gateway",
        "artifact stream chunk size",
    ),
    Setting(
        "TORCHFARM_GATEWAY_VERIFIED_MB",
        int,
        256,
        "gateway",
        "stored blobs the gateway keeps once verified: a hit on one is a byte comparison, not a "
        "decompression and sha256 (0 = none)",
    ),
    Setting(
        "TORCHFARM_GATEWAY_RECHECK_S",
        float,
        10.0,
        "gateway",
        "seconds a kept blob is served from memory after it was last compared with the store; a "
        "corrupt or removed object is found after at most this long",
    ),
    Setting(
        "TORCHFARM_TLS_CERT",
        str,
        "",
        "gateway",
        "PEM certificate chain (with `TORCHFARM_TLS_KEY`): the gateway serves TLS only; without "
        "them a gateway beyond loopback refuses to start (unless `TORCHFARM_GATEWAY_INSECURE`)",
        shown="(unset: plaintext, on loopback only)",
    ),
    Setting(
        "TORCHFARM_TLS_KEY",
        str,
        "",
        "gateway",
        "the PEM private key of `TORCHFARM_TLS_CERT`; one without the other refuses to start",
        shown="(unset: plaintext, on loopback only)",
    ),
    Setting(
        "TORCHFARM_GATEWAY_INSECURE",
        bool,
        False,
        "gateway",
        "1 (`torchfarm gateway --insecure`, `torchfarm up --insecure`): listen in plaintext "
        "beyond loopback, behind a proxy that terminates TLS; logged loudly",
    ),
    Setting(
        "TORCHFARM_METRICS_HOST",
        str,
        "",
        "gateway",
        "address the gateway's `/metrics` listens on",
        shown="the gateway's host",
    ),
    Setting(
        "TORCHFARM_METRICS_PORT",
        int,
        9470,
        "gateway",
        "Prometheus `/metrics` (requests by RPC and status, hits/misses/merges, bytes served, "
        "compile seconds per pool and mode, queue depth per pool); 0 = off",
    ),
    Setting(
        "TORCHFARM_POOL",
        str,
        "auto",
        "worker",
        "queue to serve; auto = this machine's target",
    ),
    Setting(
        "TORCHFARM_DEVICE",
        str,
        "cpu",
        "worker",
        "cpu or cuda",
    ),
    Setting(
        "TORCHFARM_WORKER_CONCURRENCY",
        int,
        0,
        "worker",
        "compiles at once (threads of the worker process, each driving its own sandboxed compile "
        "child); CUDA children take the visible GPUs in turn",
        shown="CPU: a quarter of the cores, 2 to 8; CUDA: 2 per visible GPU, or the CPU figure "
        "where more",
        check=lambda v: v >= 0,
        must="at least 1 (0 = default)",
    ),
    Setting(
        "TORCHFARM_WARM_CHILDREN",
        int,
        -1,
        "worker",
        "compile children kept started and warmed up (torch, Inductor, Triton and "
        "`TORCHFARM_OP_LIBRARIES` imported; on CUDA the context made and Triton's stubs built) "
        "before any request; each still serves one request, then exits. On CPU pools these are "
        "warm parents in the same sandbox, each forking one child per request from its warmed-up "
        'state and cleaning the sandbox after it (docs/reliability.md, "Warm parents"). 0 = start'
        " one per request",
        shown="= concurrency",
        check=lambda v: v >= -1,
        must="at least 0 (-1 = as many as compiles at once)",
    ),
    Setting(
        "TORCHFARM_WARM_UP_TIMEOUT",
        float,
        300.0,
        "worker",
        "seconds a compile child may take to warm up before it is killed and replaced (with a "
        "growing pause while warm-ups keep failing)",
        check=lambda v: v > 0,
        must="positive",
    ),
    Setting(
        "TORCHFARM_SIGNING_KEY",
        str,
        "",
        "worker, `cache import`",
        "path of the farm's Ed25519 signing key (PEM, mode 0600, `torchfarm keygen PATH`); the "
        "worker's parent signs every entry with it, and no compile child sees it. A worker "
        "without it refuses to start",
        shown="(required)",
    ),
    Setting(
        "TORCHFARM_INSECURE_UNSIGNED",
        bool,
        False,
        "worker",
        "1: start without a signing key, with a loud warning; its entries are stored unsigned and"
        " no client loads them",
    ),
    Setting(
        "TORCHFARM_SANDBOX",
        str,
        "bwrap",
        "worker",
        "bwrap, or none (insecure, loud warning)",
    ),
    Setting(
        "TORCHFARM_REDELIVERY_TIMEOUT",
        float,
        0.0,
        "worker",
        "the broker's visibility timeout: an unacknowledged task goes back to its queue this long"
        " after it was taken. A compile may outlive it: the copy finds the job's lease held by "
        "the live run and ends without compiling; a dead worker's job is taken over by its "
        "waiters once its lease lapses (15 s), whatever this is",
        shown="compile timeout + 300",
        check=lambda v: v >= 0,
        must="positive (0 = the default)",
    ),
    Setting(
        "TORCHFARM_WORKER_METRICS_HOST",
        str,
        "127.0.0.1",
        "worker",
        "address the worker's `/metrics` listens on (compose: 0.0.0.0 inside its network, not "
        "published)",
    ),
    Setting(
        "TORCHFARM_WORKER_METRICS_PORT",
        int,
        0,
        "worker",
        "Prometheus `/metrics` of the worker, summed over its Celery processes: compiles by pool,"
        " mode and result, compile seconds, bytes stored",
        shown="0 (off)",
    ),
    Setting(
        "TORCHFARM_COMPILERS",
        str,
        "inductor,aoti",
        "worker",
        'the compilers this pool runs (docs/architecture.md, "Compilers"): built-ins by name, any'
        " other as `name=module:Class` (a class with a `compile` method, importable in the "
        "compile child); a request for another is refused with the list",
    ),
    Setting(
        "TORCHFARM_OP_LIBRARIES",
        str,
        "",
        "worker",
        "comma-separated Python modules the compile child imports first, so that graphs may call "
        "the custom operators they register (`transformers.integrations.moe` for transformers' "
        "MoE models); an operator's schema must match the client's",
        shown="(none)",
    ),
    Setting(
        "TORCHFARM_FAILURE_MEMORY",
        float,
        600.0,
        "worker",
        "seconds a graph whose compile raised (not a timeout or a killed child) is answered with "
        "that error without compiling again; the client then compiles locally. 0 = always retry",
    ),
    Setting(
        "TORCHFARM_LOG_FORMAT",
        str,
        "text",
        "gateway, worker",
        "`json`: one object per line (ts, level, logger, message, request_id, job_id, tenant, "
        "key, pool); a compile's lines carry the client's `x-request-id` and the compile's job id"
        " (also in the client's line about the graph) in both formats",
        choices=("text", "json"),
    ),
    Setting(
        "TORCHFARM_COMPILE_TIMEOUT_WORKER",
        float,
        1800.0,
        "worker",
        "wall clock per compile, seconds",
    ),
    Setting(
        "TORCHFARM_COMPILE_MEMORY_MB",
        int,
        -1,
        "worker",
        "address-space limit of a CPU compile child, MiB; 0 = none. Not applied on CUDA (it "
        "breaks CUDA): cap the GPU worker's container instead",
        shown="a compile's share of the host's memory (or cgroup limit) less its work dir and "
        '/dev/shm, at most 32768 (docs/reliability.md, "Memory arithmetic")',
    ),
    Setting(
        "TORCHFARM_COMPILE_DISK_MB",
        int,
        0,
        "worker",
        "size of the compile child's private work dir (a tmpfs inside its sandbox: counts against"
        " memory, vanishes with the child)",
        shown="4096, or a quarter of a compile's share if less",
    ),
    Setting(
        "TORCHFARM_MAX_ARTIFACT_BYTES",
        int,
        1 << 30,
        "worker",
        "the largest artifact a compile child may hand back; a larger one fails the compile "
        "(ABORTED, naming the limit)",
    ),
    Setting(
        "TORCHFARM_SANDBOX_BINDS",
        tuple,
        (),
        "worker",
        "comma-separated extra paths bound read-only into the compile sandbox, for a toolchain "
        "outside /usr and the Python environment (e.g. `/opt/cuda`)",
        shown="(none)",
    ),
    Setting(
        "TORCHFARM_TOOLCHAIN_CACHE",
        str,
        "",
        "worker",
        "where a worker keeps the precompiled C++ headers it builds once per toolchain (~150 MB "
        "each) for its compile children; a restarted worker reuses them",
        shown="`~/.cache/torchfarm/toolchain`",
    ),
    Setting(
        "TORCHFARM_CONCURRENT_BACKWARD",
        str,
        "auto",
        "worker",
        "1: each compile child has a helper in its sandbox that compiles a training graph's "
        "backward while the child compiles the forward; the child's backward is then a lookup of "
        "the helper's (where the two backwards' keys differ the child ends the helper and "
        "compiles it itself; a CPU compile's memory cap is split between the two; under CUDA "
        "graphs the helper sets the flags the forward's compile sets). auto (the default): on for "
        "GPU pools, off for CPU pools; 0: off. Side by side on two H200s a miss took 0.70-0.90× "
        "of a local cold compile with it against 0.93-1.04× without (bert, vit, llama, convnext, "
        "gpt2), but 1.39× against 1.13× where convnext's keys differed and the child still waited "
        "for the helper's whole compile, which it no longer does (docs/benchmarks.md, \"Novel "
        'misses")',
        choices=("auto", "1", "0"),
    ),
    Setting(
        "TORCHFARM_KERNEL_CACHE_MB",
        int,
        2048,
        "worker",
        "C++ kernel objects kept on the worker host: per pool, built by the pool itself (in the "
        "background, sandboxed, one source per build) from the sources of shared compiles' "
        "kernels and reused by every later compile on the pool, whatever the tenant (on GPU pools"
        " Triton entries and autotune results too, and on every pool the max-autotune GEMM "
        "timings the pool measured itself for the GEMMs a shared compile benchmarked); and per "
        "(pool, tenant), reused by that tenant's later **private** compiles "
        "(`TORCHFARM_PRIVATE=1`), on GPU pools with the tenant's Triton entries and autotune "
        "results (`.best_config`, GEMM timings). A sibling model does not compile its shared "
        "kernels again. Least recently used pruned past it; the host holds up to (tenants + 1) × "
        "this. No object a compile child reports reaches another tenant or a shared entry "
        '(docs/reliability.md, "Kernel reuse"). `torchfarm cache drop-kernels --pool POOL` '
        "discards a pool's, on every worker. 0 = off",
        check=lambda v: v >= 0,
        must="at least 0 (0 = off)",
    ),
    Setting(
        "TORCHFARM_KERNEL_BUILDS",
        int,
        0,
        "worker",
        "The pool's kernel builds (TORCHFARM_KERNEL_CACHE_MB) at once on this worker. They are "
        "background work: each waits until no compile runs on the worker, and runs at idle CPU "
        "and I/O priority (TORCHFARM_KERNEL_BUILD_PRIORITY). 0 = a quarter of the cores, at "
        "least 1",
        check=lambda v: v >= 0,
        must="at least 0 (0 = a quarter of the cores)",
    ),
    Setting(
        "TORCHFARM_KERNEL_BUILD_PRIORITY",
        str,
        "idle",
        "worker",
        "The CPU and I/O priority of the pool's kernel builds: `idle` (SCHED_IDLE, the idle I/O "
        "class, the builder's session at autogroup nice 19: they take only time nothing else on "
        "the host wants) or `normal` (the compiles' priority: for hosts whose every core is "
        "always busy, such as a CI machine's test farms, where idle builds may wait minutes). "
        "Either way a build waits until no compile runs on the worker",
        choices=("idle", "normal"),
    ),
    Setting(
        "TORCHFARM_KERNEL_NAMES",
        str,
        "unique",
        "worker",
        "How compile children name Triton kernels: `unique` (Inductor's default, by what they "
        "fuse and their position in the graph) or `content` (every kernel `triton_`, so a "
        "tenant's Triton cache serves the same kernel at another position of a sibling model: a "
        "max-autotune sibling compiled in 10.1 s instead of 14.8 s on an H200, "
        "docs/benchmarks.md). With `content` GPU profiles show `triton_` for each kernel",
        choices=("unique", "content"),
    ),
    Setting(
        "TORCHFARM_SPREAD_TUNING",
        bool,
        False,
        "worker",
        "1: on a worker with several GPUs, each compile's max-autotune candidates are benchmarked"
        " on all of them at once (Inductor's subprocess tuning pool, one process per GPU), other "
        "compiles sharing them; nothing is held exclusively, so no compile waits for a GPU. Off "
        "by default: on the bench GPT it made a 2-GPU worker's miss no faster "
        '(docs/benchmarks.md, "Two GPUs")',
    ),
    Setting(
        "TORCHFARM_KERNEL_CACHE",
        str,
        "",
        "worker",
        "where those objects live, per toolchain, pool (and tenant)",
        shown="`~/.cache/torchfarm/kernels` (`torchfarm up`: its work directory)",
    ),
    Setting(
        "TORCHFARM_CACHE_MAX_BYTES",
        int,
        10 << 30,
        "worker",
        "stored-blob budget; least recently used keys are evicted past it (0 = none)",
    ),
    Setting(
        "TORCHFARM_CACHE_TTL",
        float,
        0.0,
        "worker",
        "drop keys unused for this many seconds",
        shown="0 (never)",
    ),
    Setting(
        "TORCHFARM_ISA_PROBE_MARKER",
        str,
        "",
        "internal",
        "set by the worker for its compile children: where the probe of the host's vector "
        "instruction sets left its answer (workers/isa_verdict.py)",
    ),
    Setting(
        "TORCHFARM_TRITON_STAGED",
        str,
        "",
        "internal",
        "set in a compile child: the directory of the Triton entries staged into its sandbox "
        "(torch_adapter/worker/triton_cache.py)",
    ),
    Setting(
        "TORCHFARM_PRECOMPILED_HEADERS_DIR",
        str,
        "",
        "internal",
        "set by the worker for its compile children: the directory of the precompiled C++ "
        "headers of this toolchain (torch_adapter/worker/precompiled_headers.py)",
    ),
)

BY_NAME = {s.name: s for s in SETTINGS}
_overrides: dict[str, str] = {}  # override(): values that win over the environment


def setting(short: str) -> Setting:
    """The table's entry for TORCHFARM_<short>."""
    return BY_NAME[PREFIX + short]


def name(short: str) -> str:
    """The variable's full name, checked against the table."""
    return setting(short).name


def default(short: str) -> Any:
    return setting(short).default


def raw(short: str) -> str:
    """The variable's text as set in this process ("" when unset): for a caller whose
    fallback is not the table's default."""
    entry = setting(short)
    return _overrides.get(entry.name, os.environ.get(entry.name, ""))


def check(short: str, value: Any) -> Any:
    """`value`, if TORCHFARM_<short> takes it (else its one message)."""
    setting(short).validate(value)
    return value


def get(short: str) -> Any:
    """The variable's value, typed and validated; its default when unset or blank."""
    return check(short, setting(short).parse(raw(short)))


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Within the block, `get` answers these values (short names: SKIP_TRACING=False) instead
    of the environment's, in this process only (a child process inherits nothing); None
    leaves a variable as it is."""
    saved = dict(_overrides)
    _overrides.update({name(k): setting(k).text(v) for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def export(**values: Any) -> None:
    """Set these variables in os.environ, for the child processes this one starts or forks
    (short names: ISA_PROBE_MARKER=path)."""
    os.environ.update(environ(**values))


def environ(**values: Any) -> dict[str, str]:
    """A child process's variables for these values (short names: REDIS_URL=url)."""
    return {name(k): setting(k).text(v) for k, v in values.items()}


def markdown() -> str:
    """The README's configuration table: every variable but the internal ones."""
    rows = [s.row() for s in SETTINGS if s.owner != "internal"]
    return "\n".join(["| variable | used by | default | meaning |", "|---|---|---|---|", *rows])
