"""The gRPC side of the client: one Get call per graph. It asks by the key the client
computed (and the sizes the entries' guards are checked on); a hit answers with the artifact
as stored (zstd), decompressed while it arrives; a miss answers `missing`, and the payload then
follows on the same stream, with streamed progress until the artifact. Compile (the payload
alone, artifact decoded) stays for tools and tests; Lookup for `torchfarm doctor`.

Several gateways: TORCHFARM_ADDR takes a comma-separated list of IP:port, or a DNS name
(`host:port`, `dns:///host:port`) that resolves to every gateway; the channel balances calls
over them with gRPC's round-robin policy. A call whose gateway is lost under it (UNAVAILABLE,
or silent past the inactivity limit) is made again, and round-robin gives it a gateway still
up: its job lives on the farm's Redis, so the other gateway joins the same compile.

A farm may hang without closing anything (a stopped gateway, a dead network path): the
channel sends keepalive pings, and a Compile that hears nothing (no progress, no chunk) for
TORCHFARM_INACTIVITY_TIMEOUT is cancelled, so the training step compiles locally after
seconds, not after the whole compile timeout. The gateway sends progress every second.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import ipaddress
import json
import logging
import queue
import random
import threading
import time
import typing
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc
import zstandard

from torchfarm import signing
from torchfarm.contract import busy
from torchfarm.errors import FarmError, UntrustedEntry
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc
from torchfarm.settings import ClientSettings

log = logging.getLogger("torchfarm.client")
T = TypeVar("T")
MAX_MESSAGE = 256 << 20
# Every target is balanced over all its addresses (a list, or a name with several records).
ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
# Pings on an open connection, even while a call only waits (the gateway permits them every
# 5 s): a connection that stops answering fails its calls instead of hanging. The inactivity
# deadline below usually acts first; the pings also keep idle NAT/proxy paths open.
KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


class FarmBusy(FarmError):
    """The tenant's own streams held its share of the gateway and it said when to ask again
    (contract/busy.py): asked again until the compile timeout, never compiled locally."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class GatewayLost(FarmError):
    """The gateway went away under a call (UNAVAILABLE, or `silent`): another may answer it."""

    def __init__(self, message: str, silent: bool = False):
        super().__init__(message)
        self.silent = silent


def target(addr: str) -> str:
    """gRPC's target for TORCHFARM_ADDR: one address or name as given (a name resolving to
    several addresses is balanced over them all), or a comma-separated list of IP:port as an
    `ipv4:`/`ipv6:` target. gRPC resolves no list of names: give those one DNS name."""
    items = [a.strip() for a in addr.split(",") if a.strip()]
    if len(items) < 2:
        return addr.strip()
    families = set()
    for item in items:
        host = item.rpartition(":")[0].removeprefix("[").removesuffix("]")
        try:
            families.add(ipaddress.ip_address(host).version)
        except ValueError:
            raise FarmError(
                f"TORCHFARM_ADDR {addr!r}: a list takes IP:port only ({item!r} is not); give "
                "several gateways a DNS name that resolves to them all (dns:///name:port)"
            ) from None
    if len(families) > 1:
        raise FarmError(f"TORCHFARM_ADDR {addr!r}: a list is all IPv4 or all IPv6")
    return f"ipv{families.pop()}:{','.join(items)}"


def _attempts(addr: str, silent: bool) -> int:
    """How many times a call may meet a lost gateway. A closed one fails the call at once:
    once more than the gateways listed, at least 3 (a name may stand for several, and
    round-robin skips a gateway only once its connection has closed). A silent one costs the
    inactivity limit each time: once per gateway listed (a name: once; a hung gateway's
    connection stays up, so round-robin may pick it again)."""
    listed = len([a for a in addr.split(",") if a.strip()])
    return listed if silent else max(3, listed + 1)


@functools.cache
def channel(addr: str, tls_ca: str = "") -> grpc.Channel:
    """The client's channel to a farm, kept for the process's life."""
    return open_channel(addr, tls_ca)


def open_channel(addr: str, tls_ca: str = "") -> grpc.Channel:
    """A new channel to a farm, balanced over its gateways: TLS when `tls_ca` names PEM roots
    to trust (or "system")."""
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.service_config", ROUND_ROBIN),
        *KEEPALIVE,
    ]
    if not tls_ca:
        return grpc.insecure_channel(target(addr), options=options)
    roots = None
    if tls_ca != "system":
        with open(tls_ca, "rb") as f:
            roots = f.read()
    return grpc.secure_channel(
        target(addr), grpc.ssl_channel_credentials(root_certificates=roots), options=options
    )


def _failing_over(settings: ClientSettings, call: Callable[[], T]) -> T:
    """`call`, made again while its gateway is lost under it (GatewayLost), up to
    _attempts: the channel's round-robin then picks a gateway that is still up; and while
    the farm is busy (FarmBusy), after a wait that grows with jitter, up to the compile
    timeout."""
    lost, busy_count = 0, 0  # calls whose gateway was lost; refusals of a busy farm
    deadline = time.monotonic() + settings.compile_timeout_s
    while True:
        try:
            return call()
        except GatewayLost as e:
            lost += 1
            if lost >= _attempts(settings.addr, e.silent):
                raise
            log.info("gateway lost (%s); asking again (attempt %d)", e, lost + 1)
            time.sleep(0.1 * lost)  # the balancer hears of the closed connection
        except FarmBusy as e:
            wait = max(e.retry_after_s, min(busy.MAX_WAIT_S, 0.1 * 2**busy_count))
            wait *= random.uniform(0.5, 1.5)  # ranks refused together do not return together
            if time.monotonic() + wait > deadline:
                raise
            if not busy_count:
                log.info("the farm is busy (%s); asking again", e)
            busy_count += 1
            time.sleep(wait)


@functools.cache
def _farm_stub(farm_channel: grpc.Channel) -> pb_grpc.FarmStub:
    return pb_grpc.FarmStub(farm_channel)


_connected: set[grpc.Channel] = set()
_connecting = threading.Lock()  # one first connection per process, early or on demand


def _stub(settings: ClientSettings) -> pb_grpc.FarmStub:
    """The channel's stub, once the channel has connected. Waiting for that is checked once
    per channel (it cost ~0.7 ms and a thread per call): a gateway lost later fails the
    call at once (UNAVAILABLE), and the channel reconnects by itself."""
    with _connecting:
        farm_channel = channel(settings.addr, settings.tls_ca)
        if farm_channel not in _connected:
            try:
                grpc.channel_ready_future(farm_channel).result(timeout=settings.connect_timeout_s)
            except grpc.FutureTimeoutError:
                raise FarmError(
                    f"farm at {settings.addr} unreachable within "
                    f"{settings.connect_timeout_s:g} s"
                    + (
                        " (over TLS: is TORCHFARM_TLS_CA the gateway's CA?)"
                        if settings.tls_ca
                        else ""
                    )
                ) from None
            _connected.add(farm_channel)
    return _farm_stub(farm_channel)


def connect_early(settings: ClientSettings, key_work: Callable[[], object] = lambda: None) -> None:
    """Connect to the farm and fetch its verify keys (which checks the token) on a thread,
    while Dynamo traces the first graph: the first graph's ask then costs one round trip,
    not a connection, a TLS handshake and an Info call too. The channel comes first: a skip
    hit's first call (client/packages.py) asks for its package as soon as torchfarm.compile
    returns, and opened a channel of its own while this thread ran `key_work` first (0.34 s
    on an H200 under cProfile, 2026-11-29). `key_work` (the key's one-time parts: the
    target's compiler and CPU probes, memoized, milliseconds) runs next. Errors are left for
    the first real call to meet and report."""
    if not settings.addr:
        return

    def run() -> None:
        for work in (
            functools.partial(_stub, settings),
            key_work,
            functools.partial(verifier, settings),
        ):
            try:
                work()
            except Exception:  # reported by the first real call
                pass

    threading.Thread(target=run, name="torchfarm-connect", daemon=True).start()


def _metadata(settings: ClientSettings, request_id: str) -> list[tuple[str, str]]:
    metadata = [("x-request-id", request_id)] if request_id else []
    if settings.token:
        metadata.append(("authorization", f"Bearer {settings.token}"))
    return metadata


def lookup(
    key: str, settings: ClientSettings, private: bool = False, request_id: str = ""
) -> list[pb.Candidate]:
    """The entries cached for a graph's public key (`contract.cache_key.public_key`, computed
    by the client as the gateway computes it: the payload is not sent), with the guards under
    which each applies; `private`: the tenant's own entries of that graph."""
    stub = _stub(settings)

    def ask() -> list[pb.Candidate]:
        try:
            reply = stub.Lookup(
                pb.LookupRequest(key=key, private=private),
                timeout=settings.inactivity_timeout_s,
                metadata=_metadata(settings, request_id),
            )
        except grpc.RpcError as e:
            raise _rpc_error(e) from None
        return list(reply.candidates)

    return _failing_over(settings, ask)


def _rpc_error(e: grpc.RpcError, suffix: str = "") -> FarmError:
    """A failed call as FarmError (its message ending in `suffix`, e.g. the job's id);
    GatewayLost when another gateway may answer it."""
    message = f"{e.code().name}: {e.details()}{suffix}"
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        trailers = dict(getattr(e, "trailing_metadata", lambda: None)() or ())
        retry_ms = trailers.get(busy.RETRY_AFTER_MS, "")
        # Others hold the gateway's streams: compile here now rather than wait on them.
        if retry_ms.isdigit() and trailers.get(busy.SCOPE) != busy.GATEWAY:
            return FarmBusy(message, int(retry_ms) / 1000)
    lost = e.code() == grpc.StatusCode.UNAVAILABLE
    return (GatewayLost if lost else FarmError)(message)


@dataclasses.dataclass(frozen=True)
class Received:
    """An artifact as it arrived: header, bytes (size and digest verified), where the time
    went (rpc_s: request sent -> header; transfer_s: header -> last chunk, decompress_s
    included; wire_bytes: chunk bytes received) and the Missing the farm said first, if any."""

    header: pb.ArtifactHeader
    data: bytes
    timings: dict[str, float]
    missing: pb.Missing | None = None


@dataclasses.dataclass(frozen=True)
class Listeners:
    """Who hears one Get besides its caller: `request_id` appears in the gateway's and the
    worker's log lines, `on_progress` sees its progress events, `on_manifest` a prefetch
    manifest (sent before the head's artifact)."""

    request_id: str = ""
    on_progress: Callable[[pb.Progress], None] | None = None
    on_manifest: Callable[[pb.Manifest], None] | None = None


def get(
    ask: pb.Ask,
    request: pb.CompileRequest | None,
    settings: ClientSettings,
    listeners: Listeners = Listeners(),
    payload: Callable[[], bytes] | None = None,
) -> Received:
    """One graph in one call: `ask` first; `request` (the payload, made by `payload` where
    it has none yet) only if the farm answers `missing` (None: a miss ends the call,
    FarmError)."""
    stub = _stub(settings)
    compile_request = None if request is None else functools.partial(_completed, request, payload)
    return _failing_over(
        settings, functools.partial(_get_once, stub, ask, compile_request, settings, listeners)
    )


def _get_once(
    stub: pb_grpc.FarmStub,
    ask: pb.Ask,
    request: Callable[[], pb.CompileRequest] | None,
    settings: ClientSettings,
    listeners: Listeners,
) -> Received:
    """A small hit in one unary Hit call; else Get: after Hit's `missing`, with the ask and
    the payload (`request()`) sent together."""
    missed = None
    if settings.addr not in _without_hit:
        started = time.monotonic()
        reply = _hit(stub, ask, settings, listeners.request_id)
        if reply is not None and reply.HasField("header"):
            if reply.HasField("manifest") and listeners.on_manifest:
                listeners.on_manifest(reply.manifest)
            decoder = _Decoder(reply.header)
            rpc_s = time.monotonic() - started
            decoder.feed(reply.data)
            return _received(reply.header, decoder, started, rpc_s)
        if reply is not None and reply.HasField("missing"):
            if request is None:
                raise FarmError("the farm has no entry for this ask")
            missed = reply.missing
    outbox: queue.SimpleQueue[pb.GetRequest | None] = queue.SimpleQueue()
    outbox.put(pb.GetRequest(ask=ask))
    if missed is not None and request is not None:  # the payload with the ask: the gateway
        outbox.put(pb.GetRequest(compile=request()))  # reads it after `missing`

    def requests() -> Iterator[pb.GetRequest]:
        while (message := outbox.get()) is not None:
            yield message

    missing: list[pb.Missing] = [missed] if missed is not None else []

    def on_missing(event: pb.Missing) -> None:
        if missed is None:
            missing.append(event)
            if request is not None:
                outbox.put(pb.GetRequest(compile=request()))
        if request is not None and listeners.on_progress:  # the compile is on its way to a queue
            listeners.on_progress(pb.Progress(stage=pb.Progress.QUEUED))
        outbox.put(None)

    try:
        received = _receive(
            stub.Get(
                requests(),
                timeout=settings.compile_timeout_s,
                metadata=_metadata(settings, listeners.request_id),
            ),
            settings,
            listeners.on_progress,
            on_missing,
            listeners.on_manifest,
        )
    finally:
        outbox.put(None)  # a hit: the request stream ends with the ask
    return dataclasses.replace(received, missing=missing[0] if missing else None)


def _completed(
    request: pb.CompileRequest, payload: Callable[[], bytes] | None
) -> pb.CompileRequest:
    """The request with its payload, made here (a miss) if it has none yet."""
    if payload is not None and not request.graph:
        request.graph = payload()
    return request


def verified_artifact(received: Received, key: str, trusted: signing.Verifier) -> pb.Artifact:
    """The Artifact of `received`, once a trusted key has signed it for `key` (the public key
    this client computed); UntrustedEntry otherwise. Parsed as protobuf only: nothing of it
    runs before the check."""
    header = received.header
    artifact = pb.Artifact.FromString(received.data)
    served = pb.Candidate(
        digest=header.digest, size=header.size, guards=artifact.guards, signature=header.signature
    )
    if not signing.entry_verifies(trusted, key, served):
        raise UntrustedEntry(f"the artifact of key {key[:16]} is not signed by the farm")
    return artifact


# Gateways (by the farm's address) of a release without the Hit call: asked with Get only.
_without_hit: set[str] = set()


def _hit(
    stub: pb_grpc.FarmStub, ask: pb.Ask, settings: ClientSettings, request_id: str
) -> pb.HitReply | None:
    """The Hit call's reply; None where the farm's gateway has no Hit call (remembered)."""
    try:
        return stub.Hit(
            ask, timeout=settings.inactivity_timeout_s, metadata=_metadata(settings, request_id)
        )
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            _without_hit.add(settings.addr)
            return None
        raise _rpc_error(e) from None


def fetch(
    request: pb.CompileRequest,
    settings: ClientSettings,
    on_progress: Callable[[pb.Progress], None] | None = None,
    request_id: str = "",
) -> tuple[pb.ArtifactHeader, bytes]:
    """Compile: send one graph's payload; the header and the artifact bytes (verified)."""
    stub = _stub(settings)

    def compile_once() -> Received:
        return _receive(
            stub.Compile(
                request,
                timeout=settings.compile_timeout_s,
                metadata=_metadata(settings, request_id),
            ),
            settings,
            on_progress,
        )

    received = _failing_over(settings, compile_once)
    return received.header, received.data


def _receive(
    call,
    settings: ClientSettings,
    on_progress: Callable[[pb.Progress], None] | None,
    on_missing: Callable[[pb.Missing], None] | None = None,
    on_manifest: Callable[[pb.Manifest], None] | None = None,
) -> Received:
    """Read a CompileEvent stream to its artifact, decoding chunks as they arrive. Callers
    pass the call unnamed: a failed stream's call is freed as its FarmError is raised, and
    the error holds nothing of it. A call freed at the interpreter's exit (kept by an error
    kept: a job's future, an uncaught one's traceback) can wait forever in its finalizer
    for a lock that gRPC's daemon threads, stopped there wherever they were, hold: the
    process hung after its traceback (CI, the channel's spin thread handling the call's
    last events)."""
    outcome = _read(call, settings, on_progress, on_missing, on_manifest)
    del call  # this frame is in the error's traceback
    if isinstance(outcome, FarmError):
        raise outcome
    return outcome


def _read(
    call,
    settings: ClientSettings,
    on_progress: Callable[[pb.Progress], None] | None,
    on_missing: Callable[[pb.Missing], None] | None,
    on_manifest: Callable[[pb.Manifest], None] | None,
) -> Received | FarmError:
    """_receive's reading: its failure returned, with no traceback or context (which hold
    this frame and the call)."""
    started = time.monotonic()
    header: pb.ArtifactHeader | None = None
    decoder: _Decoder | None = None
    rpc_s = 0.0  # request sent -> header
    silence = _SilenceGuard(call, settings.inactivity_timeout_s)
    job_id = ""  # the compile the farm runs for us, as its logs name it
    try:
        for event in call:
            silence.heard()
            kind = event.WhichOneof("event")
            if kind == "progress":
                job_id = event.progress.job_id or job_id
                if on_progress:
                    on_progress(event.progress)
            elif kind == "missing" and on_missing:
                on_missing(event.missing)
            elif kind == "manifest" and on_manifest:
                on_manifest(event.manifest)
            elif kind == "header":
                header = event.header
                rpc_s = time.monotonic() - started
                decoder = _Decoder(header)
                if on_progress:
                    on_progress(pb.Progress(stage=pb.Progress.DOWNLOADING))
            elif kind == "chunk":
                if decoder is None:
                    raise FarmError("the farm sent artifact bytes before their header")
                decoder.feed(event.chunk)
    except grpc.RpcError as e:
        # The error is the call: its traceback (this frame, gRPC's) holds it, a cycle that
        # only a garbage collection frees, maybe the interpreter's exit's.
        e.with_traceback(None)
        job = f" [job {job_id}]" if job_id else ""
        if silence.fired:
            return GatewayLost(
                f"farm silent for {settings.inactivity_timeout_s:g} s "
                f"(no progress, no data; TORCHFARM_INACTIVITY_TIMEOUT){job}",
                silent=True,
            )
        return _rpc_error(e, job)
    except FarmError as e:  # bytes refused: the call ends here
        call.cancel()
        return e.with_traceback(None)
    finally:
        silence.close()
    if header is None or decoder is None:
        return FarmError("the farm ended the stream without an artifact")
    try:
        return _received(header, decoder, started, rpc_s)
    except FarmError as e:  # the digest check
        return e.with_traceback(None)


def _received(
    header: pb.ArtifactHeader, decoder: _Decoder, started: float, rpc_s: float
) -> Received:
    """The artifact `decoder` was fed, checked, with where its time went since `started`
    (rpc_s: until the header came)."""
    data = decoder.result()
    timings = {
        "rpc_s": rpc_s,
        "transfer_s": time.monotonic() - started - rpc_s,
        "decompress_s": decoder.seconds,
        "wire_bytes": decoder.wire_bytes,
    }
    return Received(header, data, timings)


class _Decoder:
    """The artifact from its chunks: decompressed as they arrive (encoding "zstd"), never
    past the header's size (a small chunk that would inflate to gigabytes stops at one block
    past it), then checked against its size and sha256."""

    def __init__(self, header: pb.ArtifactHeader):
        if header.encoding not in ("", "zstd"):
            raise FarmError(f"unknown artifact encoding {header.encoding!r}")
        self.header = header
        self.parts: list[bytes] = []
        self.size = self.wire_bytes = 0
        self.seconds = 0.0
        # the writer only calls write(): this object is its sink
        sink = typing.cast(typing.IO[bytes], self)
        self.zstd = (
            zstandard.ZstdDecompressor().stream_writer(sink, write_return_read=True)
            if header.encoding
            else None
        )

    def feed(self, chunk: bytes) -> None:
        self.wire_bytes += len(chunk)
        if self.zstd is None:
            self.write(chunk)
            return
        started = time.monotonic()
        try:
            self.zstd.write(chunk)
        except zstandard.ZstdError as e:
            raise FarmError(f"the artifact does not decompress: {e}") from None
        self.seconds += time.monotonic() - started

    def write(self, part: bytes) -> int:
        """The decompressor's output (or an unencoded chunk)."""
        self.size += len(part)
        if self.size > self.header.size:
            raise FarmError("the artifact exceeds the size its header gave; not loading it")
        self.parts.append(bytes(part))
        return len(part)

    def result(self) -> bytes:
        data = b"".join(self.parts)
        if len(data) != self.header.size or hashlib.sha256(data).hexdigest() != self.header.digest:
            raise FarmError("artifact failed its digest check; not loading it")
        return data


class _SilenceGuard:
    """Cancels a streaming call once nothing has arrived on it for `limit_s`."""

    def __init__(self, call: grpc.Future, limit_s: float):
        self.call, self.limit_s = call, limit_s
        self.fired = False
        self._heard, self._done = threading.Event(), threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="torchfarm-silence").start()

    def heard(self) -> None:
        self._heard.set()

    def close(self) -> None:
        self._done.set()
        self._heard.set()

    def _watch(self) -> None:
        while not self._done.is_set():
            # Cleared before the wait: silence is measured from no earlier than the last event.
            self._heard.clear()
            if not self._heard.wait(self.limit_s) and not self._done.is_set():
                self.fired = True
                self.call.cancel()
                return


# ---- Signing: the keys this process trusts -----------------------------------------------
_farm_keys: dict[tuple[str, str, str], signing.Verifier] = {}
_asking_keys = threading.Lock()  # asked once, early (connect_early) or by the first load


def verifier(settings: ClientSettings, request_id: str = "") -> signing.Verifier:
    """The keys entries must be signed with: TORCHFARM_VERIFY_KEYS (pinned), else the ones
    the gateway serves, asked once per process over the same authenticated channel."""
    if settings.verify_keys:
        return signing.Verifier.parse(settings.verify_keys)
    farm = (settings.addr, settings.tls_ca, settings.token)
    with _asking_keys:
        if farm not in _farm_keys:
            _farm_keys[farm] = _served_keys(settings, request_id)
    if not _farm_keys[farm]:
        raise UntrustedEntry(
            "the farm publishes no verify key (TORCHFARM_VERIFY_KEYS on its gateway) and this "
            "client pins none: loading nothing from it"
        )
    return _farm_keys[farm]


def _served_keys(settings: ClientSettings, request_id: str) -> signing.Verifier:
    """The keys the gateway serves (Farm.Info)."""
    stub = _stub(settings)

    def ask() -> signing.Verifier:
        try:
            reply = stub.Info(
                pb.InfoRequest(),
                timeout=settings.connect_timeout_s + 30,
                metadata=_metadata(settings, request_id),
            )
        except grpc.RpcError as e:
            raise _rpc_error(e) from None
        return signing.Verifier(reply.verify_keys)

    return _failing_over(settings, ask)
