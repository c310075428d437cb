"""The worker's side of the queue: it registers the compile task on the shared Celery app
(torchfarm.queue) and runs each job (workers/run.py) under its lease.

A job ends with exactly one JobOutcome on the job board (stored, uncached, failed, timed out
or worker error), which wakes its waiters at once.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import threading
import time

from celery import Celery
from google.protobuf import json_format

from torchfarm import signing
from torchfarm.cache import pools
from torchfarm.cache.store import Store
from torchfarm.compiler import compilers
from torchfarm.compiler.target import local_target
from torchfarm.contract import modes
from torchfarm.contract.pools import describe, pool_name
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.queue import TASK_NAME, job_from_json, make_celery
from torchfarm.settings import WorkerSettings
from torchfarm.workers import canary, entry, metrics, run_kernels, sandbox, toolchain
from torchfarm.workers.run import CompileRun, Ended, Result, log_fields
from torchfarm.workers.slots import SLOTS

log = logging.getLogger("torchfarm.worker")


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
    key (workers/run.py); any failure ends the job with an outcome, so waiting clients hear
    of it at once."""
    settings = WorkerSettings(**task.app.conf.torchfarm_worker)
    store = _store(settings.redis_url, settings.broker_url, settings.blob_url)
    job = job_from_json(job_json)
    started = time.perf_counter()
    try:
        with SLOTS.taken(), store.jobs.lease(job.job_id, WORKER_NAME) as leased:
            if leased:
                ended = CompileRun(job, settings, store, _pool_of(task)).run()
            else:  # a redelivered copy of a task whose first run is alive: it stays the one
                ended = Ended(Result.DUPLICATE)
                log.info(
                    "skipped %s: %s runs it (the broker delivered it again)",
                    job.key[:16],
                    store.jobs.lease_holder(job.job_id) or "another worker",
                )
    except Exception as e:
        log.exception("worker error on %s", job.key[:16], extra=log_fields(job))
        ended = Ended(Result.ERROR)
        _end_with_worker_error(task, store, job, e)
    metrics.record(
        _pool_of(task),
        modes.named(job.options.mode),
        ended.result.value,
        time.perf_counter() - started,
        ended.stored_bytes,
    )
    return ended.result.value


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


# ---- Signing: the worker vouches for what it stored (torchfarm/signing.py) ---------------
def load_signer(settings: WorkerSettings) -> signing.Signer | None:
    """The farm's signing key, read by this trusted parent only (compile children get
    neither the variable nor the file); a worker without one refuses to start unless the
    operator asked for unsigned entries, which no client loads."""
    if settings.signing_key:
        try:
            return entry.signer(settings.signing_key)
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


def _pool_of(task) -> str:
    return task.request.delivery_info.get("routing_key", "")


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
    toolchain.start_in_background(settings, then=run_kernels.start_compile_builds)
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
