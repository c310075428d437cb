"""Celery app and the compile task: one queue per hardware pool.

Tasks carry JSON only (never pickle). acks_late + reject_on_worker_lost: a worker killed
mid-compile leaves its message unacknowledged, and the broker hands it to another worker.
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

from torchfarm.cache.store import Store
from torchfarm.compiler.target import describe, local_target, pool_name
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import WorkerSettings, broker_url
from torchfarm.workers import metrics, sandbox

log = logging.getLogger("torchfarm.worker")
TASK_NAME = "torchfarm.compile"
_GRAPH_CODE_CHARS = 20_000  # the readable graph kept with an entry, for `torchfarm cache show`


def make_celery(redis_url: str, broker: str = "", visibility_timeout_s: float = 3600) -> Celery:
    app = Celery("torchfarm", broker=broker_url(redis_url, broker))
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        # Unacknowledged tasks of a dead worker are swept back to their queue this long after
        # delivery; the sweep runs every tenth of that (at most every 10 s).
        broker_transport_options={
            "visibility_timeout": visibility_timeout_s,
            "unacked_restore_interval": max(1, min(10, int(visibility_timeout_s / 10))),
            "unacked_restore_throttle": 1,
        },
        worker_hijack_root_logger=False,
    )
    app.task(name=TASK_NAME, bind=True)(compile_graph)
    return app


@functools.cache
def _store(redis_url: str, broker: str) -> Store:
    return Store.from_url(redis_url, broker)


def compile_graph(task, key: str, job_id: str, job: dict) -> str:
    """Compile the queued payload of job `job_id` in the sandbox and store the artifact under
    `key`; any failure ends the job with an error, so waiting clients hear of it at once."""
    settings = WorkerSettings(**task.app.conf.torchfarm_worker)
    store = _store(settings.redis_url, settings.broker_url)
    started = time.perf_counter()
    try:
        result, stored_bytes = _compile_and_store(task, key, job_id, job, settings, store)
    except Exception as e:
        log.exception("worker error on %s", key[:16])
        store.count(_pool_of(task), compile_failures=1)
        store.finish_job(job_id, error=f"worker error: {type(e).__name__}: {e}")
        result, stored_bytes = "error", 0
    metrics.record(
        _pool_of(task),
        job.get("options", {}).get("mode") or "default",
        result,
        time.perf_counter() - started,
        stored_bytes,
    )
    return result


def _compile_and_store(
    task, key: str, job_id: str, job: dict, settings: WorkerSettings, store: Store
) -> tuple[str, int]:
    """The task's result (compiled, failed, cached, expired) and the bytes it stored."""
    if store.done(job_id):  # a redelivered task whose first run finished
        return "cached", 0
    payload = store.job_payload(job_id)
    if payload is None:
        store.finish_job(job_id, error="the job's payload expired before a worker took it")
        return "expired", 0
    store.set_status(job_id, "compiling")
    target = json_format.ParseDict(job["target"], pb.Target())
    options = json_format.ParseDict(job["options"], pb.Options())
    log.info(
        "compiling %s (%s) for tenant %s",
        key[:16],
        job.get("label", ""),
        job["tenant"],
        extra={"request_id": job.get("request_id", ""), "tenant": job["tenant"], "key": key},
    )
    try:
        data = sandbox.run_compile(
            payload,
            target,
            options,
            job.get("size_hints", {}),
            settings,
            on_stage=lambda stage: store.set_status(job_id, stage),
        )
    except sandbox.CompileFailed as e:
        log.warning("compile of %s failed: %s", key[:16], str(e)[-3000:])
        store.count(_pool_of(task), compile_failures=1)
        store.finish_job(
            job_id, error=str(e), remember_s=settings.failure_memory_s if e.lasting else 0
        )
        return "failed", 0
    artifact = pb.Artifact.FromString(data)
    pool = _pool_of(task)
    store.count(pool, compiles=1, compile_seconds=artifact.compile_seconds)  # before waiters wake
    _, cached = store.put_artifact(
        key,
        job_id,
        data,
        {
            "guards_expr": artifact.guards_expr,
            "compile_seconds": round(artifact.compile_seconds, 3),
            "tenant": job["tenant"],
            "private": job.get("private", False),
            "mode": options.mode or "default",
            "pool": pool,
            "target": describe(target),
            "torch_version": target.torch_version,
            "nodes": sum(artifact.op_counts.values()),
            "op_counts": dict(artifact.op_counts),
            "kernels": [
                {"name": k.name, "kind": k.kind, "source_bytes": k.source_bytes}
                for k in artifact.kernels
            ],
            "tuned_kernels": len(artifact.tuned_configs),
            "objects": [
                {"source_sha256": n.source_sha256[:16], "bytes": len(n.binary)}
                for n in artifact.natives
            ],
            "graph_code": artifact.graph_code[:_GRAPH_CODE_CHARS],
            "worker": socket.gethostname(),
        },
    )
    log.info(
        "%s %s: %d bytes, %.1f s",
        "stored" if cached else "answered (cache full)",
        key[:16],
        len(data),
        artifact.compile_seconds,
        extra={"request_id": job.get("request_id", ""), "key": key, "pool": pool},
    )
    if not cached:
        return "uncached", 0
    evicted = store.evict(settings.cache_max_bytes, settings.cache_ttl_s)
    if evicted:
        log.info("evicted %d keys to fit the cache budget", len(evicted))
    return "compiled", len(data)


def _pool_of(task) -> str:
    return task.request.delivery_info.get("routing_key", "")


def _heartbeat(store: Store, pool: str, info: dict, every_s: float = 10) -> None:
    while True:
        try:
            store.register_pool(pool, info)
        except Exception as e:  # Redis restarting: keep trying, the worker stays up
            log.warning("pool heartbeat failed: %s", e)
        time.sleep(every_s)


def run_worker(settings: WorkerSettings) -> None:
    """Serve this machine's pool (or settings.pool) until stopped."""
    sandbox.check_available(settings)
    target = local_target(settings.device)
    pool = pool_name(target) if settings.pool == "auto" else settings.pool
    app = make_celery(
        settings.redis_url, settings.broker_url, visibility_timeout_s=settings.visibility_timeout_s
    )
    app.conf.torchfarm_worker = dataclasses.asdict(settings)
    if settings.metrics_port:
        metrics.serve(settings.metrics_port)
    info = {"target": json_format.MessageToDict(target), "describe": describe(target)}
    threading.Thread(
        target=_heartbeat,
        args=(Store.from_url(settings.redis_url, settings.broker_url), pool, info),
        daemon=True,
        name="pool-heartbeat",
    ).start()
    log.info("worker serving pool %s (%s)", pool, describe(target))
    app.worker_main(
        [
            "worker",
            "-Q",
            pool,
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
