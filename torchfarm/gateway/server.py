"""The gRPC gateway: authenticate, validate and size, key, answer hits, single-flight misses.

It never unpickles or evaluates anything a client sends: it hashes the payload, looks the
key up in Redis, and on a miss queues a Celery task on the pool that matches the target.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from torchfarm.cache.store import Store
from torchfarm.compiler.cache_key import cache_key, canonical_options, job_id
from torchfarm.compiler.inductor import MODES
from torchfarm.compiler.target import describe, pool_name
from torchfarm.gateway import auth, metrics
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc
from torchfarm.settings import GatewaySettings, broker_url, parse_tenants
from torchfarm.workers.app import TASK_NAME, make_celery
from torchfarm.workers.sandbox import TIMED_OUT

log = logging.getLogger("torchfarm.gateway")
POLL_S = 0.05
MAX_SIZE_HINTS = 4096
_SYMBOL = re.compile(r"[a-z]{1,3}\d{1,9}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_REQUEST_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
PROGRESS_EVERY_S = 1.0
# A job's status (set by its worker) as the client's progress stage; anything else: queued.
_STAGES = {"compiling": pb.Progress.COMPILING, "autotuning": pb.Progress.AUTOTUNING}


class FarmServicer(pb_grpc.FarmServicer):
    def __init__(self, settings: GatewaySettings, store: Store):
        self.settings = settings
        self.store = store
        self.tenants = parse_tenants(settings.tenants)
        self.celery = make_celery(settings.redis_url, settings.broker_url)
        self._waiting: dict[str, int] = {}  # per tenant: requests waiting on a compile
        self._waiting_lock = threading.Lock()

    def _authenticate(self, context) -> str:
        tenant = auth.tenant_for(auth.bearer_token(context.invocation_metadata()), self.tenants)
        if tenant is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown token")
        return tenant

    def Lookup(self, request: pb.CompileRequest, context) -> pb.LookupReply:
        tenant = self._authenticate(context)
        options = self._validate(request, context)
        key = cache_key(request.graph, request.target, options, tenant if request.private else None)
        return pb.LookupReply(
            key=key,
            candidates=[
                pb.Candidate(digest=e["digest"], guards_expr=e.get("guards_expr", ""))
                for e in self.store.entries(key)
            ],
        )

    def Compile(self, request: pb.CompileRequest, context) -> Iterator[pb.CompileEvent]:
        tenant = self._authenticate(context)
        options = self._validate(request, context)
        key = cache_key(request.graph, request.target, options, tenant if request.private else None)
        job = job_id(key, request.size_hints)
        rid = _request_id(context)
        started = time.monotonic()

        hit = self._cached(key, request.digest)
        if hit is not None:
            log.info(
                "hit %s for %s: %s",
                key[:16],
                tenant,
                request.label,
                extra={"request_id": rid, "tenant": tenant, "key": key},
            )
            self.store.record_hit(key, hit[0], len(hit[1]))
            metrics.RESULTS.labels("hit").inc()
            metrics.BYTES_SERVED.inc(len(hit[1]))
            yield from self._send(key, *hit, source="hit")
            return

        failure = self.store.failure(job)
        if failure is not None:
            metrics.RESULTS.labels("failed").inc()
            context.abort(
                grpc.StatusCode.ABORTED,
                f"compile failed on the farm: {failure}\n(a "
                "recent compile of this graph, not retried for the worker's "
                "TORCHFARM_FAILURE_MEMORY)",
            )
        pool = pool_name(request.target)
        pools = self.store.pools()
        if pool not in pools:
            served = (
                "; ".join(
                    f"{name} ({info.get('describe', '')})" for name, info in sorted(pools.items())
                )
                or "none"
            )
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no pool serves target {describe(request.target)} (pool {pool}). "
                f"Pools available: {served}",
            )
        with self._compile_slot(tenant, context):
            source = (
                "miss"
                if self._claim_and_enqueue(key, job, request, options, pool, tenant, rid)
                else "merged"
            )
            self.store.count(pool, **{"misses" if source == "miss" else "merges": 1})
            metrics.RESULTS.labels(source).inc()
            log.info(
                "%s %s for %s: %s",
                source,
                key[:16],
                tenant,
                request.label,
                extra={"request_id": rid, "tenant": tenant, "key": key, "pool": pool},
            )
            yield from self._wait(
                key, job, request, options, pool, tenant, rid, started, source, context
            )

    @contextlib.contextmanager
    def _compile_slot(self, tenant: str, context) -> Iterator[None]:
        """Hold one of the tenant's compile slots (TORCHFARM_TENANT_MAX_COMPILES, counted per
        gateway) while its request waits on a compile; none free: RESOURCE_EXHAUSTED."""
        limit = self.settings.tenant_max_compiles
        with self._waiting_lock:
            waiting = self._waiting.get(tenant, 0)
            if limit and waiting >= limit:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"tenant {tenant or '(open farm)'} already waits on {waiting} "
                    f"compiles (limit {limit}); retry when one finishes",
                )
            self._waiting[tenant] = waiting + 1
        try:
            yield
        finally:
            with self._waiting_lock:
                self._waiting[tenant] -= 1

    def _validate(self, request: pb.CompileRequest, context) -> pb.Options:
        if not request.graph:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty graph payload")
        if len(request.graph) > self.settings.max_payload_bytes:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"graph payload {len(request.graph)} bytes exceeds the limit of "
                f"{self.settings.max_payload_bytes}",
            )
        if request.target.device not in ("cpu", "cuda") or not request.target.torch_version:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "target needs device 'cpu' or 'cuda' and a torch_version",
            )
        if len(request.size_hints) > MAX_SIZE_HINTS or any(
            not _SYMBOL.fullmatch(name) or value < 0 for name, value in request.size_hints.items()
        ):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"size_hints: at most {MAX_SIZE_HINTS} entries of symbol -> size >= 0",
            )
        if request.digest and not _DIGEST.fullmatch(request.digest):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "digest: 64 lowercase hex digits")
        if (request.options.mode or "default") not in MODES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown mode {request.options.mode!r}; one of {', '.join(MODES)}",
            )
        try:
            return canonical_options(request.options)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad options: {e}")

    def _cached(self, key: str, digest: str) -> tuple[dict, bytes] | None:
        """The entry the client chose (its guards hold there), or else an unguarded entry
        (it holds everywhere), verified; None means compile."""
        entry = (
            self.store.entry(key, digest)
            if digest
            else next((e for e in self.store.entries(key) if not e.get("guards_expr")), None)
        )
        if entry is None:
            return None
        data = self.store.read_blob(key, entry)
        if data is None:
            log.warning("dropped corrupt or missing blob %s of %s", entry["digest"][:16], key[:16])
            return None
        return entry, data

    def _claim_and_enqueue(self, key, job, request, options, pool, tenant, rid) -> bool:
        ttl = int(self.settings.compile_timeout_s) + 60
        if not self.store.claim(job, ttl):
            return False
        self.store.put_job(job, request.graph)
        details = {
            "target": json_format.MessageToDict(request.target),
            "options": json_format.MessageToDict(options),
            "size_hints": dict(request.size_hints),
            "tenant": tenant,
            "private": request.private,
            "label": request.label,
            "request_id": rid,
        }
        self.celery.send_task(TASK_NAME, args=[key, job, details], queue=pool, routing_key=pool)
        return True

    def _wait(self, key, job, request, options, pool, tenant, rid, started, source, context):
        deadline = started + self.settings.compile_timeout_s
        next_progress = 0.0
        while context.is_active():
            now = time.monotonic()
            # Read the claim first: a worker sets the entry (or error) and drops the claim in
            # one step, so a claim seen gone here means the checks below see its outcome.
            claimed = self.store.claimed(job)
            digest = self.store.done(job)
            hit = (
                (self._cached(key, digest) or self.store.uncached(job, digest)) if digest else None
            )
            if hit is not None:
                yield from self._send(key, *hit, source=source)
                saved = hit[0].get("compile_seconds", 0.0) if source == "merged" else 0.0
                self.store.count(pool, bytes_served=len(hit[1]), compile_seconds_saved=saved)
                metrics.BYTES_SERVED.inc(len(hit[1]))
                if source == "miss":
                    metrics.COMPILE_SECONDS.labels(pool, options.mode).observe(
                        hit[0].get("compile_seconds", 0.0)
                    )
                return
            error = self.store.error(job)
            if error is not None:
                status = (
                    grpc.StatusCode.DEADLINE_EXCEEDED
                    if error.startswith(TIMED_OUT)
                    else grpc.StatusCode.ABORTED
                )
                context.abort(status, f"compile failed on the farm: {error}")
            if now > deadline:
                context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"compile did not finish in {self.settings.compile_timeout_s:.0f} s",
                )
            if not claimed:  # the compiler vanished without a result: take over
                self._claim_and_enqueue(key, job, request, options, pool, tenant, rid)
            if now >= next_progress:
                stage = _STAGES.get(self.store.status(job), pb.Progress.QUEUED)
                yield pb.CompileEvent(progress=pb.Progress(stage=stage, elapsed_s=now - started))
                next_progress = now + PROGRESS_EVERY_S
            time.sleep(POLL_S)

    def _send(self, key: str, entry: dict, data: bytes, source: str) -> Iterator[pb.CompileEvent]:
        yield pb.CompileEvent(
            header=pb.ArtifactHeader(
                key=key,
                digest=entry["digest"],
                size=len(data),
                source=source,
                compile_seconds=entry.get("compile_seconds", 0.0),
            )
        )
        step = self.settings.chunk_bytes
        for offset in range(0, len(data), step):
            yield pb.CompileEvent(chunk=data[offset : offset + step])


class _Undecodable:
    """What a request that is not the method's message decodes to (see UndecodableRequests)."""

    def __init__(self, error: Exception):
        self.error = error


class UndecodableRequests(grpc.ServerInterceptor):
    """Bytes that do not parse as the method's message get INVALID_ARGUMENT, not gRPC's
    INTERNAL "Exception deserializing request!"."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        behavior_field = "unary_unary" if handler.unary_unary else "unary_stream"
        behavior = getattr(handler, behavior_field)

        def tolerant_parse(data: bytes):
            try:
                return parse(data)
            except Exception as e:  # DecodeError, and whatever else a parser raises
                return _Undecodable(e)

        def checked(request, context):
            if isinstance(request, _Undecodable):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the request is not a valid {handler_call_details.method} "
                    f"message: {request.error}",
                )
            return behavior(request, context)

        return handler._replace(request_deserializer=tolerant_parse, **{behavior_field: checked})


def _request_id(context) -> str:
    """The client's x-request-id (it follows the compile into the worker's log), or a new one."""
    for name, value in context.invocation_metadata() or ():
        if name == "x-request-id" and _REQUEST_ID.fullmatch(value):
            return value
    return uuid.uuid4().hex[:16]


class AdminServicer(pb_grpc.AdminServicer):
    """Operators' RPCs, for tokens in TORCHFARM_ADMINS only."""

    def __init__(self, settings: GatewaySettings, store: Store):
        self.store = store
        self.tenants = parse_tenants(settings.tenants)
        self.admins = parse_tenants(settings.admins, "TORCHFARM_ADMINS")

    def _authorize(self, context) -> str:
        token = auth.bearer_token(context.invocation_metadata())
        admin = auth.tenant_for(token, self.admins) if self.admins else None
        if admin is not None:
            return admin
        if auth.tenant_for(token, self.tenants) is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown token")
        context.abort(
            grpc.StatusCode.PERMISSION_DENIED, "admin RPCs need a token listed in TORCHFARM_ADMINS"
        )

    def Stats(self, request: pb.StatsRequest, context) -> pb.StatsReply:
        self._authorize(context)
        return pb.StatsReply(json=json.dumps(self.store.summary()))

    def Drop(self, request: pb.DropRequest, context) -> pb.DropReply:
        admin = self._authorize(context)
        if not _DIGEST.fullmatch(request.key):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "key must be 64 hex digits")
        dropped = self.store.drop(request.key)
        log.info("admin %s dropped %d entries of %s", admin, dropped, request.key[:16])
        return pb.DropReply(entries=dropped)


def build_server(settings: GatewaySettings) -> tuple[grpc.Server, int]:
    """A started-ready server (call .start()) and the port it bound."""
    store = Store.from_url(settings.redis_url, settings.broker_url)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.threads),
        interceptors=[metrics.MetricsInterceptor(), UndecodableRequests()],
        options=[("grpc.max_receive_message_length", settings.max_payload_bytes + (1 << 20))],
    )
    pb_grpc.add_FarmServicer_to_server(FarmServicer(settings, store), server)
    pb_grpc.add_AdminServicer_to_server(AdminServicer(settings, store), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    service_name = pb.DESCRIPTOR.services_by_name["Farm"].full_name
    health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (
            service_name,
            pb.DESCRIPTOR.services_by_name["Admin"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    address = f"{settings.host}:{settings.port}"
    if settings.tls_cert:
        with open(settings.tls_key, "rb") as key, open(settings.tls_cert, "rb") as cert:
            credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    return server, port


def serve(settings: GatewaySettings, ready=None) -> None:
    """Run the gateway until SIGINT/SIGTERM; `ready(port)` is called once it listens."""
    import signal

    server, port = build_server(settings)
    server.start()
    pools = Store.from_url(settings.redis_url, settings.broker_url).pools
    metrics.serve_metrics(
        settings.metrics_port,
        broker_url(settings.redis_url, settings.broker_url),
        lambda: list(pools()),
    )
    log.info(
        "gateway listening on %s:%d (%s)",
        settings.host,
        port,
        "TLS" if settings.tls_cert else "plaintext",
    )
    if ready:
        ready(port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait()
