"""Prometheus metrics of the gateway: requests by RPC and status, cache results, bytes
served, compile seconds of the misses it waited for (per pool and mode), and the depth of
each pool's queue (read from the broker at scrape time)."""

from __future__ import annotations

import grpc
import redis
from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

REQUESTS = Counter(
    "torchfarm_requests", "RPCs answered, by method and gRPC status", ["rpc", "status"]
)
RESULTS = Counter(
    "torchfarm_cache_results",
    "Compile requests by outcome: hit, miss, merged, failed (a remembered failure)",
    ["result"],
)
BYTES_SERVED = Counter("torchfarm_bytes_served", "Artifact bytes streamed to clients")
COMPILE_SECONDS = Histogram(
    "torchfarm_compile_seconds",
    "Worker compile time of each miss",
    ["pool", "mode"],
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800),
)


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts every RPC with the status it ended with."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        rpc = handler_call_details.method.rsplit("/", 1)[-1]
        single = "unary_unary" if handler.unary_unary else "stream_unary"
        if getattr(handler, single):

            def unary(request, context, behavior=getattr(handler, single)):
                try:
                    response = behavior(request, context)
                except BaseException:
                    _count(rpc, context, failed=True)
                    raise
                _count(rpc, context)
                return response

            return handler._replace(**{single: unary})
        field = (
            "unary_stream"
            if handler.unary_stream
            else "stream_stream"
            if handler.stream_stream
            else ""
        )
        if field:

            def stream(request, context, behavior=getattr(handler, field)):
                try:
                    yield from behavior(request, context)
                except BaseException:
                    _count(rpc, context, failed=True)
                    raise
                _count(rpc, context)

            return handler._replace(**{field: stream})
        return handler


def _count(rpc: str, context, failed: bool = False) -> None:
    code = context.code() if hasattr(context, "code") else None
    status = code.name if code is not None else ("UNKNOWN" if failed else "OK")
    REQUESTS.labels(rpc, status).inc()


class QueueDepth:
    """Collector: messages waiting in each live pool's Celery queue (a Redis list), and each
    pool's workers that passed their canary compile (0: the pool cannot compile yet)."""

    def __init__(self, broker: redis.Redis, pools) -> None:
        self.broker, self.pools = broker, pools

    def collect(self):
        family = GaugeMetricFamily(
            "torchfarm_queue_depth", "Compile tasks waiting, by pool", labels=["pool"]
        )
        ready = GaugeMetricFamily(
            "torchfarm_pool_ready_workers",
            "Workers whose canary compile succeeded, by pool",
            labels=["pool"],
        )
        try:
            for name, pool in self.pools().items():
                family.add_metric([name], self.broker.llen(name))
                ready.add_metric(
                    [name], sum(w.readiness.state == "ready" for w in pool.workers.values())
                )
        except redis.RedisError:
            pass  # Redis down: report no depth rather than fail the scrape
        yield family
        yield ready


def serve_metrics(host: str, port: int, broker_url: str, pools) -> None:
    """Expose /metrics on `host`:`port` (port 0: do not serve). The host defaults to the
    gateway's own, never every interface unless asked (TORCHFARM_METRICS_HOST)."""
    if port:
        REGISTRY.register(QueueDepth(redis.Redis.from_url(broker_url), pools))
        start_http_server(port, addr=host.strip("[]"))
