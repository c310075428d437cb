"""The worker's side of the queue: it registers the compile task on the shared Celery app
(torchfarm.queue) and runs each job in the sandbox.

A job ends with exactly one JobOutcome on the job board (stored, uncached, failed, timed out
or worker error), which wakes its waiters at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterator

import redis
from celery import Celery
from google.protobuf import json_format

from torchfarm import signing
from torchfarm.cache import pools
from torchfarm.cache.artifacts import CacheFull, digest_of
from torchfarm.cache.store import Store
from torchfarm.compiler import compilers
from torchfarm.compiler.target import local_target
from torchfarm.contract.cache_key import STRUCTURE, key_parts, key_values, private_key, public_key
from torchfarm.contract.options import compiler_of
from torchfarm.contract.pools import describe, pool_name
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.queue import TASK_NAME, job_from_json, make_celery
from torchfarm.settings import WorkerSettings
from torchfarm.workers import canary, kernel_builder, kernel_cache, metrics, sandbox, toolchain

log = logging.getLogger("torchfarm.worker")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_GRAPH_CODE_CHARS = 20_000  # the readable graph kept with an entry, for `torchfarm cache show`


def worker_celery(settings: WorkerSettings) -> Celery:
    """The shared Celery app with the compile task registered: the worker's alone."""
    app = make_celery(
        settings.redis_url, settings.broker_url, visibility_timeout_s=settings.visibility_timeout_s
    )
    app.conf.torchfarm_worker = dataclasses.asdict(settings)
    # A broker at its memory limit refuses the write that records a delivered task: Celery
    # counts that a channel error, fatal unless retried ("Unrecoverable error:
    # OutOfMemoryError" ended the worker). Retried, the consumer reconnects and waits for
    # room; a task lost that way is queued again by its waiters (gateway/coordinator.py).
    app.conf.broker_channel_error_retry = True
    app.task(name=TASK_NAME, bind=True)(compile_graph)
    return app


@functools.cache
def _store(redis_url: str, broker: str, blob_url: str) -> Store:
    return Store.from_url(redis_url, broker, blob_url)


def compile_graph(task, job_json: dict) -> str:
    """Compile the queued payload of a job in the sandbox and store the artifact under its
    key; any failure ends the job with an outcome, so waiting clients hear of it at once."""
    settings = WorkerSettings(**task.app.conf.torchfarm_worker)
    store = _store(settings.redis_url, settings.broker_url, settings.blob_url)
    job = job_from_json(job_json)
    started = time.perf_counter()
    try:
        with SLOTS.taken(), store.jobs.lease(job.job_id, WORKER_NAME) as leased:
            if leased:
                result, stored_bytes = _compile_and_store(task, job, settings, store)
            else:  # a redelivered copy of a task whose first run is alive: it stays the one
                result, stored_bytes = "duplicate", 0
                log.info(
                    "skipped %s: %s runs it (the broker delivered it again)",
                    job.key[:16],
                    store.jobs.lease_holder(job.job_id) or "another worker",
                )
    except Exception as e:
        log.exception("worker error on %s", job.key[:16], extra=log_fields(job))
        result, stored_bytes = "error", 0
        _end_with_worker_error(task, store, job, e)
    metrics.record(
        _pool_of(task),
        job.options.mode or "default",
        result,
        time.perf_counter() - started,
        stored_bytes,
    )
    return result


def _end_with_worker_error(task, store: Store, job: pb.Job, error: Exception) -> None:
    """End a job the worker could not run with WORKER_ERROR; if even that cannot be written
    (the broker full or away), give its claim back (a release needs no memory), so that its
    waiters queue it again at once and its tenant's slot is free. The worker lives on."""
    try:
        store.jobs.finish(
            job.job_id,
            pb.JobOutcome(
                kind=pb.JobOutcome.WORKER_ERROR,
                error=f"worker error: {type(error).__name__}: {error}",
            ),
        )
        store.counters.count(_pool_of(task), compile_failures=1)
    except Exception:
        extra = log_fields(job)
        log.exception(
            "could not record the end of %s: its claim goes back", job.key[:16], extra=extra
        )
        try:
            store.jobs.release(job.job_id)
        except Exception:  # unreachable: its heartbeat stops, and its waiters take it over
            log.exception("could not release the claim of %s", job.key[:16], extra=extra)


def _compile_and_store(
    task, job: pb.Job, settings: WorkerSettings, store: Store
) -> tuple[str, int]:
    """The task's result (compiled, uncached, failed, cached, abandoned, expired) and the
    bytes stored."""
    taken = time.time()
    extra = log_fields(job)
    if store.jobs.outcome(job.job_id) is not None:  # a redelivered task whose first run ended
        return "cached", 0
    if store.jobs.abandoned(job.job_id):  # every client that wanted it has gone
        store.counters.count(_pool_of(task), abandoned=1)
        store.jobs.finish(
            job.job_id,
            pb.JobOutcome(kind=pb.JobOutcome.ABANDONED, error="no client waits for it any more"),
        )
        log.info("skipped %s: no client waits for it any more", job.key[:16], extra=extra)
        return "abandoned", 0
    payload = store.jobs.payload(job.job_id)
    if payload is None:
        store.jobs.finish(
            job.job_id,
            pb.JobOutcome(
                kind=pb.JobOutcome.WORKER_ERROR,
                error="the job's payload expired before a worker took it",
            ),
        )
        return "expired", 0
    compiler = compiler_of(job.options)
    if compiler not in compilers.parse(settings.compilers):  # no child for it
        store.jobs.finish(
            job.job_id,
            pb.JobOutcome(
                kind=pb.JobOutcome.FAILED,
                error=f"pool {_pool_of(task)} does not run the compiler {compiler!r} "
                f"(its TORCHFARM_COMPILERS: {settings.compilers})",
            ),
        )
        return "failed", 0
    store.jobs.set_stage(job.job_id, pb.Progress.COMPILING)
    log.info("compiling %s (%s) for tenant %s", job.key[:16], job.label, job.tenant, extra=extra)
    handed = time.perf_counter()
    kernels = _kernel_cache(settings)
    pool_kernels = tenant_kernels = ""
    generation = 0
    if kernels:  # the pool's objects for every job; a private job's tenant's own too
        generation = store.pools.kernel_generation(_pool_of(task))
        if kernels.renew(_pool_of(task), generation):
            log.info("kernel cache: dropped (generation %d)", generation, extra=extra)
        pool_kernels = kernels.pool_dir(_pool_of(task))
        if job.private:  # private only: the tenant chooses what it holds (kernel_cache)
            tenant_kernels = kernels.tenant_dir(_pool_of(task), job.tenant)
    try:
        child = sandbox.run_compile(
            payload,
            job.target,
            job.options,
            dict(job.size_hints),
            settings,
            on_stage=lambda stage: store.jobs.set_stage(job.job_id, stage),
            abandoned=lambda: store.jobs.abandoned(job.job_id),
            kernels_from=tuple(d for d in (pool_kernels, tenant_kernels) if d),
            report_built=bool(tenant_kernels),
            report_sources=bool(pool_kernels) and not job.private,
        )
    except sandbox.CompileFailed as e:
        if e.kind == pb.JobOutcome.ABANDONED:  # its clients left: the slot is free again
            log.info("stopped %s: no client waits for it any more", job.key[:16], extra=extra)
            store.counters.count(_pool_of(task), abandoned=1)
            store.jobs.finish(job.job_id, e.outcome())
            return "abandoned", 0
        log.warning("compile of %s failed: %s", job.key[:16], str(e)[-3000:], extra=extra)
        store.counters.count(_pool_of(task), compile_failures=1)
        store.jobs.finish(
            job.job_id, e.outcome(), remember_s=settings.failure_memory_s if e.lasting else 0
        )
        return "failed", 0
    data, read_back = child.data, time.perf_counter()
    artifact = pb.Artifact.FromString(data)
    pool = _pool_of(task)
    store.counters.count(
        pool,
        compiles=1,
        compile_seconds=artifact.compile_seconds,
        gemm_candidates_benchmarked=child.kernels.gemm_candidates_benchmarked,
    )
    meta = _entry_meta(job, artifact, pool)
    meta.digest, meta.size = digest_of(data), len(data)
    meta.public_key = _graph_key(job, payload)
    _record_key_parts(meta, job, payload, artifact.structure)
    if settings.signing_key:  # else TORCHFARM_INSECURE_UNSIGNED, which run_worker warned of
        meta.signature = signing.sign_entry(_signer(settings.signing_key), meta.public_key, meta)
    timings = pb.MissTimings(
        queued_s=max(0.0, taken - job.queued_at) if job.queued_at else 0.0,
        handoff_s=child.handoff_s,
        child_s=read_back - handed - child.handoff_s,
        compile_s=artifact.compile_seconds,
    )
    try:
        entry = store.artifacts.put(job.key, data, meta)
    except CacheFull:
        log.warning("the cache's storage is full: %s served uncached", job.key[:16], extra=extra)
        timings.store_s = time.perf_counter() - read_back
        log.info("answered (cache full) %s: %d bytes", job.key[:16], len(data), extra=extra)
        store.jobs.finish(
            job.job_id,
            pb.JobOutcome(kind=pb.JobOutcome.UNCACHED, digest=meta.digest, timings=timings),
            uncached=(meta, data),
        )
        return "uncached", 0
    if STRUCTURE in meta.key_parts:
        store.structures.add(job.tenant, meta.key_parts[STRUCTURE], job.key)
    timings.store_s = time.perf_counter() - read_back
    if kernels:  # before the job ends: its tenant's next compile finds them
        undropped = store.pools.kernel_generation(pool) == generation
        if undropped:
            _keep_kernels(kernels, pool_kernels, tenant_kernels, child.kernels, extra)
        else:  # what it built may hold what was dropped (timings grown from staged ones)
            log.info("kernel cache: dropped during the compile, nothing kept", extra=extra)
        tuned = [n for n in child.kernels.built if n.startswith(kernel_cache.TUNING + "/")]
        store.counters.count(
            pool,
            kernels_reused=len(child.kernels.reused),
            tuning_stored=len(tuned) if tenant_kernels and undropped else 0,
            tuning_reused=child.kernels.tuning_reused,
            tuning_seconds_saved=child.kernels.tuning_seconds_saved,
        )
    # Logged before the job ends: its waiters wake at once (a log read then finds the line).
    log.info(
        "stored %s: %d bytes, %.1f s compiling, %.2f s hand-off to a child%s",
        job.key[:16],
        len(data),
        artifact.compile_seconds,
        child.handoff_s,
        f", backward compiled by the {artifact.backward}" if artifact.backward else "",
        extra=dict(extra, pool=pool),
    )
    store.jobs.finish(
        job.job_id,
        pb.JobOutcome(kind=pb.JobOutcome.STORED, digest=entry.digest, timings=timings),
    )
    builds = kernel_builder.builds_of(child.kernels)
    if kernels:
        builds += _pool_tuning(store, pool, generation)
    if kernels and builds:  # after the job ended: no waiter waits for builds
        kept = functools.partial(_tuning_kept, store, pool)
        queued = _pool_builds(settings).offer(pool_kernels, builds, kept)
        log.info("kernel cache: %d sources queued for the pool's builds", queued, extra=extra)
    evicted = store.artifacts.evict(settings.cache_max_bytes, settings.cache_ttl_s)
    if evicted:
        log.info("evicted %d keys to fit the cache budget", len(evicted))
    return "compiled", len(data)


def log_fields(job: pb.Job) -> dict[str, str]:
    """The `extra` of a log line about a job (logs.FIELDS): the job id the gateway logged and
    the client heard, and the request that queued it."""
    return {
        "request_id": job.request_id,
        "job_id": job.job_id,
        "tenant": job.tenant,
        "key": job.key,
    }


# ---- The tenant's kernel cache (workers/kernel_cache.py) -------------------------------
@functools.cache
def _kernel_cache(settings: WorkerSettings) -> kernel_cache.KernelCache | None:
    """This worker's kernel cache, or None where TORCHFARM_KERNEL_CACHE_MB is 0."""
    if not settings.kernel_cache_mb:
        return None
    root = settings.kernel_cache_dir or os.path.join(
        os.path.expanduser("~"), ".cache", "torchfarm", "kernels"
    )
    return kernel_cache.KernelCache(root, toolchain.toolchain_id(), settings.kernel_cache_mb << 20)


@functools.cache
def _pool_builds(settings: WorkerSettings) -> kernel_builder.PoolBuilds:
    kernels = _kernel_cache(settings)
    assert kernels is not None
    return kernel_builder.PoolBuilds(kernels, settings)


def _tuning_kept(store: Store, pool: str, source: pb.KernelBuild, stored: int) -> None:
    """A pool build's tuning results, counted as its compiles' are (`torchfarm cache stats`);
    its source remembered for the pool's other workers and for bundles."""
    if not stored:
        return
    try:  # on the builds' thread: a Redis failure costs the counters, never later builds
        store.counters.count(pool, tuning_stored=stored)
        store.pools.add_tuning(pool, [source])
    except redis.RedisError as e:
        log.warning("pool tuning not recorded: %s", e)


# pool -> (kernel generation, number of tuning builds) when this worker last read them
_tuning_seen: dict[str, tuple[int, int]] = {}


def _pool_tuning(store: Store, pool: str, generation: int) -> list[pb.KernelBuild]:
    """The pool's tuning builds (other workers', a bundle's) whenever they changed since this
    worker last read them (builds are only added, until a drop raises the generation): each
    one it has not built is queued for its own builder, which checks it as any source."""
    seen = (generation, store.pools.tuning_count(pool))
    if _tuning_seen.get(pool) == seen:
        return []
    _tuning_seen[pool] = seen
    return store.pools.tuning(pool)


def _keep_kernels(
    kernels: kernel_cache.KernelCache,
    pool_dir: str,
    tenant_dir: str,
    files: pb.KernelFiles,
    extra: dict,
) -> None:
    """Keep what a private compile built for its tenant, and mark the objects a compile
    reused as used now; a failure costs later compiles only."""
    try:
        kernels.touch(pool_dir, files.reused)
        stored = kernels.keep(tenant_dir, files)[0] if tenant_dir else 0
    except OSError:
        log.exception("could not keep the compile's kernels", extra=extra)
        return
    log.info(
        "kernel cache: %d objects reused, %d kept, %d tuning results reused (%.1f s of "
        "tuning), %d GEMM candidates benchmarked",
        len(files.reused),
        stored,
        files.tuning_reused,
        files.tuning_seconds_saved,
        files.gemm_candidates_benchmarked,
        extra=extra,
    )


# ---- Signing: the worker vouches for what it stored (torchfarm/signing.py) ---------------
def load_signer(settings: WorkerSettings) -> signing.Signer | None:
    """The farm's signing key, read by this trusted parent only (compile children get
    neither the variable nor the file); a worker without one refuses to start unless the
    operator asked for unsigned entries, which no client loads."""
    if settings.signing_key:
        try:
            return _signer(settings.signing_key)
        except (OSError, ValueError) as e:
            raise SystemExit(f"torchfarm worker: TORCHFARM_SIGNING_KEY unusable: {e}") from e
    if not settings.insecure_unsigned:
        raise SystemExit(
            "torchfarm worker: no TORCHFARM_SIGNING_KEY. Make one with `torchfarm keygen "
            "PATH` and give its public key to the gateway (TORCHFARM_VERIFY_KEYS), or set "
            "TORCHFARM_INSECURE_UNSIGNED=1 (clients will load none of this worker's entries)."
        )
    log.warning(
        "!!! TORCHFARM_INSECURE_UNSIGNED: entries are stored unsigned; no client will load "
        "them. Set TORCHFARM_SIGNING_KEY. !!!"
    )
    return None


@functools.cache
def _signer(path: str) -> signing.Signer:
    return signing.Signer.from_file(path)


def _graph_key(job: pb.Job, payload: bytes) -> str:
    """The public key of the payload this worker compiled, recomputed here (what the entry's
    signature names): a Job forged on the broker cannot get another graph's key signed."""
    graph_key = public_key(payload, job.target, job.options)
    expected = private_key(graph_key, job.tenant) if job.private else graph_key
    if job.key != expected:
        raise ValueError(f"the job's key {job.key[:16]} is not its payload's ({expected[:16]})")
    return graph_key


def _record_key_parts(meta: pb.EntryMeta, job: pb.Job, payload: bytes, structure: str) -> None:
    """What the entry's key is made of, computed here from what was compiled (a client's parts
    are never stored), to explain the misses of the same program. The structure comes from the
    child: it only groups entries, so a malformed one is left out."""
    if not _DIGEST.fullmatch(structure):
        structure = ""
    meta.key_parts.update(key_parts(payload, job.target, job.options, structure))
    meta.key_values.update(key_values(job.target, job.options))


def _entry_meta(job: pb.Job, artifact: pb.Artifact, pool: str) -> pb.EntryMeta:
    """The index entry of a compiled artifact (digest and sizes are the cache's to fill)."""
    return pb.EntryMeta(
        guards=artifact.guards,
        compile_seconds=round(artifact.compile_seconds, 3),
        tenant=job.tenant,
        private=job.private,
        mode=job.options.mode or "default",
        pool=pool,
        target=describe(job.target),
        torch_version=job.target.torch_version,
        nodes=sum(artifact.op_counts.values()),
        op_counts=dict(artifact.op_counts),
        kernels=artifact.kernels,
        tuned_kernels=len(artifact.tuned_configs),
        objects=[
            pb.NativeObjectInfo(source_sha256=n.source_sha256[:16], bytes=len(n.binary))
            for n in artifact.natives
        ],
        graph_code=artifact.graph_code[:_GRAPH_CODE_CHARS],
        worker=socket.gethostname(),
    )


def _pool_of(task) -> str:
    return task.request.delivery_info.get("routing_key", "")


class _Slots:
    """How many compiles this worker runs, and since when it has had a free slot: what its
    heartbeat reports, so that a job's waiters can tell a job waiting its turn from one lost
    in the queue (cache/pools.py PoolState.took_nothing_since)."""

    def __init__(self) -> None:
        self.concurrency = 1
        self.running = 0
        self.free_since = time.monotonic()
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def taken(self) -> Iterator[None]:
        with self.lock:
            self.running += 1
        try:
            yield
        finally:
            with self.lock:
                self.running -= 1
                if self.running == self.concurrency - 1:  # a slot has just come free
                    self.free_since = time.monotonic()

    def free_for_s(self) -> float:
        """Seconds this worker has had a free slot without a break; -1 while all are busy."""
        with self.lock:
            return -1.0 if self.running >= self.concurrency else time.monotonic() - self.free_since


SLOTS = _Slots()  # the compile tasks of this worker process
WORKER_NAME = f"{socket.gethostname()}.{os.getpid()}"  # as Celery's node name ends


class _Heartbeat:
    """This worker's entry in the pool registry: its target and readiness, refreshed every
    `every_s` so the registry forgets a worker that died."""

    def __init__(self, store: Store, pool: str, info: dict, every_s: float = 10):
        self.store, self.pool, self.info, self.every_s = store, pool, info, every_s
        self.worker = WORKER_NAME
        self.readiness = pools.Readiness()
        self.lock = threading.Lock()  # the last write is the latest readiness

    def beat(self) -> None:
        try:
            with self.lock:
                self.store.pools.register(
                    self.pool,
                    self.worker,
                    dict(self.info, free_for_s=SLOTS.free_for_s()),
                    self.readiness,
                    os.getpid(),
                    socket.gethostname(),
                )
        except Exception as e:  # Redis restarting: keep trying, the worker stays up
            log.warning("pool heartbeat failed: %s", e)

    def set(self, readiness: pools.Readiness) -> None:
        self.readiness = readiness
        self.beat()

    def start(self) -> None:
        def forever() -> None:
            while True:
                self.beat()
                time.sleep(self.every_s)

        threading.Thread(target=forever, daemon=True, name="pool-heartbeat").start()


def run_worker(settings: WorkerSettings) -> None:
    """Serve this machine's pool (or settings.pool) until stopped."""
    try:
        compilers.parse(settings.compilers)
    except ValueError as e:
        raise SystemExit(f"torchfarm worker: {e}") from None
    sandbox.check_available(settings)
    load_signer(settings)
    try:  # a wrong TORCHFARM_BLOB_URL fails here, not on a first compile
        artifacts = _store(settings.redis_url, settings.broker_url, settings.blob_url).artifacts
        artifacts.blobs.check()
        artifacts.record_store()
    except Exception as e:
        raise SystemExit(f"torchfarm worker: blob store {settings.blob_url}: {e}") from e
    toolchain.start_in_background(settings)
    sandbox.pool(settings)  # compile children warm up while the worker starts
    target = local_target(settings.device)
    pool = pool_name(target) if settings.pool == "auto" else settings.pool
    app = worker_celery(settings)
    SLOTS.concurrency = settings.concurrency
    if settings.metrics_port:
        metrics.serve(settings.metrics_port, settings.metrics_host)
    info = {
        "target": json_format.MessageToDict(target),
        "describe": describe(target),
        "concurrency": settings.concurrency,  # for Info and `torchfarm doctor`
        "warm_children": settings.warm_children,
    }
    heartbeat = _Heartbeat(
        Store.from_url(settings.redis_url, settings.broker_url, settings.blob_url), pool, info
    )
    heartbeat.start()  # "starting": the gateway queues this pool's jobs meanwhile
    log.info("worker for pool %s (%s): canary compile", pool, describe(target))
    readiness = canary.run(settings, target)
    heartbeat.set(readiness)
    if readiness.state != "ready":
        # Exit, not retry: canary.py's docstring says why.
        raise SystemExit(f"torchfarm worker: pool {pool} cannot compile: {readiness.error}")
    log.info("worker serving pool %s (%s)", pool, describe(target))
    app.worker_main(
        [
            "worker",
            "-Q",
            pool,
            # Threads: a compile runs in its sandboxed child, the task only drives it, and
            # the warm children of the one worker process serve every task.
            "-P",
            "threads",
            "-c",
            str(settings.concurrency),
            "-n",
            f"{pool}@{socket.gethostname()}.{os.getpid()}",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel",
            "INFO",
        ]
    )
