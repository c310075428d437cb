"""Prometheus metrics of a worker: compiles by pool, mode and result, their duration, the
artifact bytes stored, and its compile children (compiles at once, children kept warm and
ready now, children replaced, the wait for a child to take a request).

The metrics use prometheus_client's multiprocess mode (each process writes its values to
files in a directory private to this worker, and the worker's main process serves their sum
on TORCHFARM_WORKER_METRICS_PORT), so that they hold whichever Celery pool runs the tasks.
prometheus_client picks that mode when it is first imported, so `enable` runs before
anything imports it.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile


def enable() -> None:
    """Give this worker its own multiprocess directory; call before the pool forks."""
    if "prometheus_client" in sys.modules:
        raise RuntimeError("prometheus_client was imported before worker metrics were enabled")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="torchfarm-worker-metrics-")


def serve(port: int, host: str = "127.0.0.1") -> None:
    """Expose the sum over this worker's processes on /metrics at `host`:`port` (loopback
    unless TORCHFARM_WORKER_METRICS_HOST says otherwise, e.g. inside a compose network)."""
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    start_http_server(port, addr=host, registry=registry)


@functools.cache
def _metrics():
    from prometheus_client import Counter, Histogram

    return (
        Counter(
            "torchfarm_worker_compiles",
            "Compile tasks by pool, mode and result "
            "(compiled, failed, error, cached, abandoned, expired, duplicate)",
            ["pool", "mode", "result"],
        ),
        Histogram(
            "torchfarm_worker_compile_seconds",
            "Wall time of each compile task that ran a compile, sandbox start included",
            ["pool", "mode"],
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800),
        ),
        Counter("torchfarm_worker_bytes_stored", "Artifact bytes written to the cache", ["pool"]),
    )


def record(pool: str, mode: str, result: str, seconds: float, stored_bytes: int) -> None:
    """One finished compile task."""
    compiles, durations, stored = _metrics()
    compiles.labels(pool, mode, result).inc()
    if result in ("compiled", "failed"):
        durations.labels(pool, mode).observe(seconds)
    if stored_bytes:
        stored.labels(pool).inc(stored_bytes)


@functools.cache
def _child_metrics():
    from prometheus_client import Counter, Gauge, Histogram

    return (
        Gauge(
            "torchfarm_worker_settings",
            "The worker's compile settings: concurrency (compiles at once, "
            "TORCHFARM_WORKER_CONCURRENCY) and warm_children (TORCHFARM_WARM_CHILDREN)",
            ["setting"],
            multiprocess_mode="livemax",
        ),
        Gauge(
            "torchfarm_worker_warm_children_ready",
            "Compile children warmed up and waiting for a request",
            multiprocess_mode="livesum",
        ),
        Counter(
            "torchfarm_worker_children_replaced",
            "Idle compile children killed and replaced, by reason (died, hung in warm-up)",
            ["reason"],
        ),
        Counter(
            "torchfarm_worker_children_taken",
            "Compile children taken for a request, by their state then: ready (warmed up "
            "ahead of need), warming or started (the pool had run dry)",
            ["state"],
        ),
        Histogram(
            "torchfarm_worker_child_handoff_seconds",
            "Seconds from a compile's start until a ready child had its request",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 20, 60),
        ),
    )


def configured(concurrency: int, warm_children: int) -> None:
    settings = _child_metrics()[0]
    settings.labels("concurrency").set(concurrency)
    settings.labels("warm_children").set(warm_children)


def warm_children_ready(count: int) -> None:
    _child_metrics()[1].set(count)


def replaced(reason: str) -> None:
    _child_metrics()[2].labels(reason).inc()


def taken(state: str) -> None:
    _child_metrics()[3].labels(state).inc()


def handoff(seconds: float) -> None:
    _child_metrics()[4].observe(seconds)
