"""The gRPC gateway: authenticate, validate and size requests, map outcomes to statuses.

The work itself (lookup, serve or single-flight a miss, wait) is the coordinator's
(gateway/coordinator.py). Get sends an entry's bytes as stored (zstd), Compile decoded: one
sending path, two encodings. Nothing here imports torch or the worker: the gateway hashes
payloads, reads Redis and queues Celery tasks by name (torchfarm.queue). It never unpickles
or evaluates anything a client sends.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, NoReturn

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from torchfarm import queue, signing
from torchfarm.cache import admin
from torchfarm.cache.admin import CacheAdmin
from torchfarm.cache.artifacts import VerifiedBlobs
from torchfarm.cache.pools import PoolState
from torchfarm.cache.store import Store
from torchfarm.contract.options import INDUCTOR, canonical_options, compiler_of
from torchfarm.errors import WrongBlobStore
from torchfarm.gateway import auth, metrics
from torchfarm.gateway.admission import MessageDeadlines, StreamSlots, StreamsWithoutToken
from torchfarm.gateway.coordinator import (
    CompileCall,
    Coordinator,
    Failed,
    Failure,
    Progress,
    Served,
    TooLarge,
)
from torchfarm.gateway.hit_ledger import HitLedger
from torchfarm.gateway.packages import Packages
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc
from torchfarm.settings import GatewaySettings, broker_url, env, parse_tenants

log = logging.getLogger("torchfarm.gateway")
MAX_SIZE_HINTS = 4096
MAX_ASK_SIZES = 4096  # a graph's SymInt inputs
MAX_KEY_PARTS = 64
MAX_KEY_PART_CHARS = 64  # names and values (sha256 hex digests) of Ask.key_parts
MAX_LABEL_CHARS = 200
STORED = "zstd"  # Get's encoding: the entry's bytes as the cache stores them
_SYMBOL = re.compile(r"[a-z]{1,3}\d{1,9}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_REQUEST_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_STATUS = {
    Failure.FAILED: grpc.StatusCode.ABORTED,
    Failure.WORKER_ERROR: grpc.StatusCode.ABORTED,
    Failure.TIMED_OUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Failure.NO_POOL: grpc.StatusCode.FAILED_PRECONDITION,
    Failure.TENANT_LIMIT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Failure.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
# Clients ping every 10 s (client/remote.py KEEPALIVE); accept that, even while a call only
# waits, instead of answering "too many pings" by closing the connection.
KEEPALIVE = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the RPC with `code` (context.abort raises; this says so to type checkers)."""
    context.abort(code, message)
    raise AssertionError("context.abort returned")


_REFUSED = {
    auth.Refusal.LIMITED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    auth.Refusal.UNKNOWN: grpc.StatusCode.UNAUTHENTICATED,
    auth.Refusal.NOT_ADMIN: grpc.StatusCode.PERMISSION_DENIED,
}


def _caller(context, authenticate: Callable[[object, str], str]) -> str:
    """Who `authenticate` (a tenant's or an admin's) says the caller is, or the RPC ends
    with the refusal's status."""
    try:
        return authenticate(context.invocation_metadata(), context.peer() or "")
    except auth.AccessRefused as refused:
        _abort(context, _REFUSED[refused.why], str(refused))


class FarmServicer(pb_grpc.FarmServicer):
    def __init__(
        self,
        settings: GatewaySettings,
        store: Store,
        authenticator: auth.Authenticator,
        slots: StreamSlots,
    ):
        self.settings = settings
        self.authenticator = authenticator
        self.slots = slots
        self.deadlines = MessageDeadlines(settings.message_timeout_s)
        # Signing: the keys clients verify entries with; checked here, so a typo fails at start
        self.verify_keys = list(signing.Verifier.parse(settings.verify_keys).public_keys)
        if not self.verify_keys:
            log.warning(
                "no TORCHFARM_VERIFY_KEYS: clients that pin no keys will load no artifact "
                "from this farm (give the gateway the workers' public signing key)"
            )
        store.artifacts.verified = VerifiedBlobs(settings.verified_mb << 20, settings.recheck_s)
        self.packages = Packages(store.artifacts.redis, settings.tenant_package_mb << 20)
        celery = queue.make_celery(settings.redis_url, settings.broker_url)
        self.coordinator = Coordinator(
            store,
            enqueue=lambda job, pool: queue.send_job(celery, job, pool),
            compile_timeout_s=settings.compile_timeout_s,
            tenant_max_compiles=settings.tenant_max_compiles,
        )

    def _authenticate(self, context) -> str:
        return _caller(context, self.authenticator.tenant)

    def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupReply:
        tenant = self._authenticate(context)
        if not _DIGEST.fullmatch(request.key):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "key: 64 lowercase hex digits")
        key, entries = self.coordinator.lookup(request.key, request.private, tenant)
        return pb.LookupReply(
            key=key,
            candidates=[
                pb.Candidate(digest=e.digest, guards=e.guards, size=e.size, signature=e.signature)
                for e in entries
            ],
        )

    def PutPackage(self, request: pb.PutPackageRequest, context) -> pb.PutPackageReply:
        return self.packages.put(self._authenticate(context), request, context)

    def GetPackage(self, request: pb.GetPackageRequest, context) -> pb.GetPackageReply:
        return self.packages.get(self._authenticate(context), request, context)

    def Info(self, request: pb.InfoRequest, context) -> pb.InfoReply:
        self._authenticate(context)
        pools = self.coordinator.store.pools.live()
        return pb.InfoReply(
            verify_keys=self.verify_keys,
            pools=[pool_health(pools[name]) for name in sorted(pools)],
        )

    def Compile(self, request: pb.CompileRequest, context) -> Iterator[pb.CompileEvent]:
        tenant = self._authenticate(context)
        with self.slots.held(tenant, context):
            yield from self._compile(request, tenant, _request_id(context), context, encoding="")

    def Get(self, requests: Iterator[pb.GetRequest], context) -> Iterator[pb.CompileEvent]:
        """An ask by key first: a hit is answered from it alone (no payload on the wire);
        a miss says `missing`, and the payload then follows on the same stream as a compile
        that goes on exactly as Compile (its key computed here, from the payload). Each
        message is awaited at most the message timeout, in one of the tenant's slots."""
        tenant = self._authenticate(context)
        with self.slots.held(tenant, context):
            yield from self._get(requests, tenant, context)

    def Hit(self, ask: pb.Ask, context) -> pb.HitReply:
        """Get's ask in one unary call, for a hit whose stored bytes fit one message
        (`chunk_bytes`); otherwise `missing` or `stream`, and the client goes on with Get."""
        tenant = self._authenticate(context)
        self._validate_ask(ask, context)
        try:
            hit = self._answer(ask, tenant, _request_id(context), self.settings.chunk_bytes)
        except TooLarge:
            return pb.HitReply(stream=True)
        if hit is None:
            return pb.HitReply(missing=self._missing(ask, tenant))
        served, manifest = hit
        return pb.HitReply(
            header=self._header(served, STORED), data=served.stored, manifest=manifest
        )

    def _answer(
        self, ask: pb.Ask, tenant: str, request_id: str, max_stored: int = 0
    ) -> tuple[Served, pb.Manifest | None] | None:
        """An ask's hit (Coordinator.get) and, for a program's head, what to prefetch with
        it; the program remembers what it was served. None: a miss."""
        served = self.coordinator.get(ask, tenant, request_id, max_stored)
        if served is None:
            return None
        manifest = self.coordinator.manifest(ask, tenant)
        self.coordinator.record_program(ask, tenant, served.entry.digest)
        return served, manifest

    def _missing(self, ask: pb.Ask, tenant: str) -> pb.Missing:
        return pb.Missing(explanation=self.coordinator.explain(ask, tenant))

    def _get(
        self, requests: Iterator[pb.GetRequest], tenant: str, context
    ) -> Iterator[pb.CompileEvent]:
        first = self.deadlines.next(requests, context, "ask")
        if first is None or first.WhichOneof("message") != "ask":
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "Get: the first message is an ask")
        self._validate_ask(first.ask, context)
        ask = first.ask
        request_id = _request_id(context)
        hit = self._answer(ask, tenant, request_id)
        if hit is not None:
            served, manifest = hit
            if manifest is not None:
                yield pb.CompileEvent(manifest=manifest)
            yield from self._send(served, STORED)
            return
        yield pb.CompileEvent(missing=self._missing(ask, tenant))
        then = self.deadlines.next(requests, context, "payload after missing")
        if then is None:  # the client went on without the farm
            return
        if then.WhichOneof("message") != "compile":
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "Get: after missing, the next message is a compile (the payload), sent once",
            )
        yield from self._compile(
            then.compile,
            tenant,
            request_id,
            context,
            STORED,
            lambda served: self.coordinator.record_program(ask, tenant, served.entry.digest),
        )

    def _compile(
        self,
        request: pb.CompileRequest,
        tenant: str,
        request_id: str,
        context,
        encoding: str,
        on_served: Callable[[Served], None] | None = None,
    ) -> Iterator[pb.CompileEvent]:
        call = CompileCall(request, self._validate(request, context), tenant, request_id)
        for event in self.coordinator.compile(call, context.is_active):
            if isinstance(event, Progress):
                yield pb.CompileEvent(
                    progress=pb.Progress(
                        stage=event.stage, elapsed_s=event.elapsed_s, job_id=event.job_id
                    )
                )
            elif isinstance(event, Served):
                if on_served is not None:
                    on_served(event)
                yield from self._send(event, encoding)
            elif isinstance(event, Failed):
                _abort(context, _STATUS[event.kind], event.message)

    def _validate_ask(self, ask: pb.Ask, context) -> None:
        problem = _ask_problem(ask)
        if problem:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"ask: {problem}")

    def _validate(self, request: pb.CompileRequest, context) -> pb.Options:
        if not request.graph:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "empty graph payload")
        for name, field in (("graph payload", request.graph), ("descriptor", request.descriptor)):
            if len(field) > self.settings.max_payload_bytes:
                _abort(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{name} {len(field)} bytes exceeds the limit of "
                    f"{self.settings.max_payload_bytes}",
                )
        if request.target.device not in ("cpu", "cuda") or not request.target.torch_version:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "target needs device 'cpu' or 'cuda' and a torch_version",
            )
        if len(request.size_hints) > MAX_SIZE_HINTS or any(
            not _SYMBOL.fullmatch(name) or value < 0 for name, value in request.size_hints.items()
        ):
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"size_hints: at most {MAX_SIZE_HINTS} entries of symbol -> size >= 0",
            )
        if len(request.float_hints) > MAX_SIZE_HINTS or any(
            not _SYMBOL.fullmatch(name) or not math.isfinite(value)
            for name, value in request.float_hints.items()
        ):
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"float_hints: at most {MAX_SIZE_HINTS} entries of symbol -> finite value",
            )
        if request.digest and not _DIGEST.fullmatch(request.digest):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "digest: 64 lowercase hex digits")
        if request.descriptor and compiler_of(request.options) != INDUCTOR:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "descriptor: only Inductor's graphs have one (compiler "
                f"{compiler_of(request.options)!r})",
            )
        try:
            return canonical_options(request.options)
        except ValueError as e:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"bad options: {e}")

    def _send(self, served: Served, encoding: str) -> Iterator[pb.CompileEvent]:
        """The header, then the artifact's chunks: as stored (`encoding` STORED), or decoded
        one chunk at a time (verified in the same bounded way before), so a hit costs a chunk
        of memory whatever it inflates to."""
        stored = served.stored
        yield pb.CompileEvent(header=self._header(served, encoding))
        step = self.settings.chunk_bytes
        chunks = (
            (stored[i : i + step] for i in range(0, len(stored), step))
            if encoding
            else served.chunks(step)
        )
        for chunk in chunks:
            yield pb.CompileEvent(chunk=chunk)

    @staticmethod
    def _header(served: Served, encoding: str) -> pb.ArtifactHeader:
        """What the client checks the artifact's bytes against, and where they came from."""
        return pb.ArtifactHeader(
            key=served.key,
            digest=served.entry.digest,
            size=served.entry.size,
            source=served.source,
            compile_seconds=served.entry.compile_seconds,
            signature=served.entry.signature,
            timings=served.timings,
            encoding=encoding,
            stored_size=len(served.stored) if encoding else served.entry.size,
            job_id=served.job_id,
        )


def _ask_problem(ask: pb.Ask) -> str:
    """What is wrong with an ask ('' if nothing): it only names things, so bounds suffice."""
    if not _DIGEST.fullmatch(ask.key):
        return "key: 64 lowercase hex digits"
    if ask.digest and not _DIGEST.fullmatch(ask.digest):
        return "digest: empty or 64 lowercase hex digits"
    if len(ask.sizes) > MAX_ASK_SIZES or any(size < 0 for size in ask.sizes):
        return f"sizes: at most {MAX_ASK_SIZES}, each >= 0"
    if len(ask.key_parts) > MAX_KEY_PARTS or any(
        len(name) > MAX_KEY_PART_CHARS or len(value) > MAX_KEY_PART_CHARS
        for name, value in ask.key_parts.items()
    ):
        return (
            f"key_parts: at most {MAX_KEY_PARTS}, names and values of at most "
            f"{MAX_KEY_PART_CHARS} characters"
        )
    if ask.program.head and not _DIGEST.fullmatch(ask.program.head):
        return "program.head: empty or 64 lowercase hex digits"
    if len(ask.label) > MAX_LABEL_CHARS:
        return f"label: at most {MAX_LABEL_CHARS} characters"
    return ""


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
        if handler.request_streaming:
            field = "stream_stream" if handler.stream_stream else "stream_unary"
            return handler._replace(
                request_deserializer=tolerant_parse_of(parse),
                **{field: _checked_stream(getattr(handler, field), handler_call_details.method)},
            )
        behavior_field = "unary_unary" if handler.unary_unary else "unary_stream"
        behavior = getattr(handler, behavior_field)

        def checked(request, context):
            _refuse_undecodable(request, context, handler_call_details.method)
            return behavior(request, context)

        return handler._replace(
            request_deserializer=tolerant_parse_of(parse), **{behavior_field: checked}
        )


def tolerant_parse_of(parse: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def tolerant_parse(data: bytes):
        try:
            return parse(data)
        except Exception as e:  # DecodeError, and whatever else a parser raises
            return _Undecodable(e)

    return tolerant_parse


def _refuse_undecodable(request, context, method: str) -> None:
    if isinstance(request, _Undecodable):
        _abort(
            context,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is not a valid {method} message: {request.error}",
        )


def _checked_stream(behavior, method: str):
    """A request-streaming handler whose messages are each checked as they are read."""

    def checked(requests, context):
        def decoded():
            for request in requests:
                _refuse_undecodable(request, context, method)
                yield request

        return behavior(decoded(), context)

    return checked


def _request_id(context) -> str:
    """The client's x-request-id (it follows the compile into the worker's log), or a new one."""
    for name, value in context.invocation_metadata() or ():
        if name == "x-request-id" and _REQUEST_ID.fullmatch(value):
            return value
    return uuid.uuid4().hex[:16]


_POOL_STATES = {
    "starting": pb.PoolHealth.STARTING,
    "ready": pb.PoolHealth.READY,
    "failed": pb.PoolHealth.FAILED,
}
POOL_HEALTH_PREFIX = "torchfarm.pool/"  # the health service name of pool X is this + X


def pool_health(pool: PoolState) -> pb.PoolHealth:
    """A pool's readiness and size as Info reports it."""
    ready = [w for w in pool.workers.values() if w.readiness.state == "ready"]
    return pb.PoolHealth(
        name=pool.name,
        describe=pool.describe,
        state=_POOL_STATES[pool.state],
        error=pool.error,
        workers=len(pool.workers),
        ready_workers=len(ready),
        compile_slots=sum(w.concurrency for w in ready),
        warm_children=sum(w.warm_children for w in ready),
    )


class FarmHealth(health.HealthServicer):
    """gRPC health. "" and the Farm service: the gateway answers (hits are served whatever
    the pools' state). POOL_HEALTH_PREFIX + a pool's name: SERVING while one of its workers
    has passed its canary compile, NOT_SERVING while none has (starting, or every canary
    failed), SERVICE_UNKNOWN for a pool no worker serves. Pools are read at each Check; a
    Watch sees what the last Check read."""

    def __init__(self, pools: Callable[[], dict[str, PoolState]]):
        super().__init__()
        self.pools = pools
        self.known: set[str] = set()  # pools given a status so far

    def Check(self, request, context):
        if request.service.startswith(POOL_HEALTH_PREFIX):
            self.refresh()
        return super().Check(request, context)

    def refresh(self) -> None:
        pools = self.pools()
        for name in self.known - pools.keys():  # no worker serves it any more
            self.set(POOL_HEALTH_PREFIX + name, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        for name, pool in pools.items():
            serving = pool.state == "ready"
            self.set(
                POOL_HEALTH_PREFIX + name,
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING,
            )
        self.known = set(pools)


class AdminServicer(pb_grpc.AdminServicer):
    """Operators' RPCs, for tokens in TORCHFARM_ADMINS only: the `torchfarm cache` commands,
    run by cache/admin.py. Import trusts exactly the keys this gateway serves clients."""

    def __init__(
        self,
        settings: GatewaySettings,
        store: Store,
        authenticator: auth.Authenticator,
        hits: HitLedger,
    ):
        self.settings = settings
        self.cache = CacheAdmin(store)
        self.hits = hits  # written before a command reads, so it sees this gateway's hits
        self.authenticator = authenticator
        self.verify_keys = signing.Verifier.parse(settings.verify_keys).public_keys

    def _authorize(self, context) -> str:
        """The admin's name, else the RPC ends; every command starts here, so this gateway's
        counted hits are written first and what the command reads includes them."""
        name = _caller(context, self.authenticator.admin)
        self.hits.flush()
        return name

    def _run(self, context, operation: Callable[[], Any]) -> Any:
        """`operation`'s answer, or the RPC ends with the status of its refusal."""
        try:
            return operation()
        except admin.CacheOperationRefused as refused:
            _abort(context, _PROBLEMS[refused.problem], str(refused))

    def Stats(self, request: pb.StatsRequest, context) -> pb.StatsReply:
        self._authorize(context)
        return self.cache.stats()

    def Drop(self, request: pb.DropRequest, context) -> pb.DropReply:
        name = self._authorize(context)
        reply = self._run(context, lambda: self.cache.drop(request))
        log.info("admin %s dropped %d entries of %s", name, reply.entries, request.key[:16])
        return reply

    def List(self, request: pb.ListRequest, context) -> pb.ListReply:
        self._authorize(context)
        return self._run(context, lambda: self.cache.ls(request))

    def Show(self, request: pb.ShowRequest, context) -> pb.ShowReply:
        self._authorize(context)
        return self._run(context, lambda: self.cache.show(request))

    def Purge(self, request: pb.PurgeRequest, context) -> pb.PurgeReply:
        name = self._authorize(context)
        reply = self._run(context, lambda: self.cache.purge(request))
        log.info("admin %s purged %d keys (%d entries)", name, reply.keys, reply.entries)
        return reply

    def DropKernels(self, request: pb.DropKernelsRequest, context) -> pb.DropKernelsReply:
        name = self._authorize(context)
        reply = self._run(context, lambda: self.cache.drop_kernels(request))
        log.info(
            "admin %s dropped the kernel caches of pool %s (generation %d)",
            name,
            request.pool,
            reply.generation,
        )
        return reply

    def Export(self, request: pb.ExportRequest, context) -> Iterator[pb.BundleChunk]:
        self._authorize(context)
        data = self._run(context, lambda: self.cache.export(request))
        step = self.settings.chunk_bytes
        for i in range(0, len(data), step):
            yield pb.BundleChunk(data=data[i : i + step])

    def Import(self, requests: Iterator[pb.BundleChunk], context) -> pb.ImportReply:
        """The upload goes to a temporary file as it arrives (never whole in memory), up to
        admin.MAX_BUNDLE_BYTES, and is decoded up to admin.decoded_limit: past either,
        RESOURCE_EXHAUSTED, nothing stored."""
        name = self._authorize(context)
        with tempfile.TemporaryFile(prefix="torchfarm-import-") as spool:
            uploaded = 0
            for chunk in requests:
                uploaded += len(chunk.data)
                if uploaded > admin.MAX_BUNDLE_BYTES:
                    _abort(
                        context,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the bundle is over {admin.MAX_BUNDLE_BYTES} bytes; nothing imported "
                        "(direct mode, --redis, takes any size)",
                    )
                spool.write(chunk.data)
            spool.seek(0)
            trusted = signing.Verifier(self.verify_keys)
            reply = self._run(
                context,
                lambda: self.cache.import_bundle(
                    spool, trusted, self.verify_keys, max_decoded=admin.decoded_limit(uploaded)
                ),
            )
        log.info("admin %s imported %d entries", name, reply.entries)
        return reply


_PROBLEMS = {
    admin.Problem.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    admin.Problem.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    admin.Problem.UNTRUSTED: grpc.StatusCode.FAILED_PRECONDITION,
    admin.Problem.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def build_server(settings: GatewaySettings, store: Store) -> tuple[grpc.Server, int]:
    """A started-ready server (call .start()) and the port it bound."""
    slots = StreamSlots(settings.max_streams, settings.tenant_max_streams)
    without_token = (
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.threads),
        interceptors=[
            metrics.MetricsInterceptor(),
            UndecodableRequests(),
            StreamsWithoutToken(
                StreamSlots(settings.unauthenticated_streams, settings.unauthenticated_streams),
                without_token,
            ),
        ],
        options=[
            ("grpc.max_receive_message_length", settings.max_payload_bytes + (1 << 20)),
            *KEEPALIVE,
        ],
    )
    authenticator = auth.Authenticator(
        parse_tenants(settings.tenants),
        parse_tenants(settings.admins, env.name("ADMINS")),
        auth.FailureLimiter(settings.auth_failures),
        settings.legacy_tokens,
    )
    farm = FarmServicer(settings, store, authenticator, slots)
    pb_grpc.add_FarmServicer_to_server(farm, server)
    admin_servicer = AdminServicer(settings, store, authenticator, farm.coordinator.hits)
    pb_grpc.add_AdminServicer_to_server(admin_servicer, server)
    health_servicer = FarmHealth(store.pools.live)
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


def plaintext_refusal(host: str, tls: bool, insecure: bool) -> str:
    """Why a gateway on `host` must not start ('' if it may): beyond loopback, tokens and
    artifacts cross the network, so plaintext needs the operator's word (`--insecure`)."""
    if tls or insecure or _loopback(host):
        return ""
    return (
        f"refusing to listen on {host} in plaintext: give the gateway a certificate "
        "(TORCHFARM_TLS_CERT and TORCHFARM_TLS_KEY; `torchfarm up --tls-cert --tls-key`), "
        "listen on 127.0.0.1, or say --insecure (TORCHFARM_GATEWAY_INSECURE=1) behind a proxy "
        "that terminates TLS"
    )


def warn_if_open(settings: GatewaySettings) -> bool:
    """Log a loud warning (and say so) for a gateway without tenants that other machines
    can reach."""
    if settings.tenants or _loopback(settings.host):
        return False
    log.warning(
        "OPEN GATEWAY on %s: TORCHFARM_TENANTS is empty, so anyone who reaches this "
        "address may compile on the farm and read its public entries. Set "
        "TORCHFARM_TENANTS (tenant:sha256(token),...) or listen on 127.0.0.1.",
        settings.host,
    )
    return True


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def serve(settings: GatewaySettings, ready=None) -> None:
    """Run the gateway until SIGINT/SIGTERM; `ready(port)` is called once it listens."""
    import signal

    refusal = plaintext_refusal(settings.host, bool(settings.tls_cert), settings.insecure)
    if refusal:
        raise SystemExit(f"torchfarm gateway: {refusal}")
    if settings.insecure and not settings.tls_cert and not _loopback(settings.host):
        log.warning("PLAINTEXT GATEWAY on %s (--insecure): tokens cross the network", settings.host)
    store = Store.from_url(settings.redis_url, settings.broker_url, settings.blob_url)
    try:  # read through another store, every hit would drop its entry as corrupt
        store.artifacts.check_store()
    except WrongBlobStore as e:
        raise SystemExit(f"torchfarm gateway: {e}") from e
    except redis.RedisError:
        log.warning("the cache's Redis is not reachable yet: blob store not checked")
    server, port = build_server(settings, store)
    # The metrics port bound before gRPC serves: a gateway whose metrics port is taken exits
    # before anyone saw it serving (started after, it was seen ready and then died).
    metrics.serve_metrics(
        settings.metrics_host or settings.host,
        settings.metrics_port,
        broker_url(settings.redis_url, settings.broker_url),
        store.pools.live,
    )
    server.start()
    log.info(
        "gateway listening on %s:%d (%s)",
        settings.host,
        port,
        "TLS" if settings.tls_cert else "plaintext",
    )
    warn_if_open(settings)
    if ready:
        ready(port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait()
