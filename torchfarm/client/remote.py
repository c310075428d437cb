"""The gRPC side of the client: Lookup by key (entries and their guards), then one Compile
call, which alone carries the payload, with streamed progress and verified artifact bytes."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable

import grpc

from torchfarm import signing
from torchfarm.contract.cache_key import public_key
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc
from torchfarm.settings import ClientSettings

MAX_MESSAGE = 256 << 20


class FarmError(RuntimeError):
    """The farm could not provide an artifact; the message says why."""


class UntrustedEntry(FarmError):
    """An entry or artifact that no trusted key signed: never loaded, the graph compiles here."""


@functools.cache
def channel(addr: str, tls_ca: str = "") -> grpc.Channel:
    """One channel per gateway: TLS when `tls_ca` names PEM roots to trust (or "system")."""
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.max_receive_message_length", MAX_MESSAGE),
    ]
    if not tls_ca:
        return grpc.insecure_channel(addr, options=options)
    roots = None
    if tls_ca != "system":
        with open(tls_ca, "rb") as f:
            roots = f.read()
    return grpc.secure_channel(
        addr, grpc.ssl_channel_credentials(root_certificates=roots), options=options
    )


def _stub(settings: ClientSettings) -> pb_grpc.FarmStub:
    farm_channel = channel(settings.addr, settings.tls_ca)
    try:
        grpc.channel_ready_future(farm_channel).result(timeout=settings.connect_timeout_s)
    except grpc.FutureTimeoutError:
        raise FarmError(
            f"farm at {settings.addr} unreachable within "
            f"{settings.connect_timeout_s:g} s"
            + (" (over TLS: is TORCHFARM_TLS_CA the gateway's CA?)" if settings.tls_ca else "")
        ) from None
    return pb_grpc.FarmStub(farm_channel)


def _metadata(settings: ClientSettings, request_id: str) -> list[tuple[str, str]]:
    metadata = [("x-request-id", request_id)] if request_id else []
    if settings.token:
        metadata.append(("authorization", f"Bearer {settings.token}"))
    return metadata


def lookup(
    request: pb.CompileRequest, settings: ClientSettings, request_id: str = ""
) -> list[pb.Candidate]:
    """The entries cached for this graph, with the guards under which each applies. Sends
    the key, computed here as the gateway computes it, not the payload."""
    stub = _stub(settings)
    key = public_key(request.graph, request.target, request.options)
    try:
        reply = stub.Lookup(
            pb.LookupRequest(key=key, private=request.private),
            timeout=settings.connect_timeout_s + 30,
            metadata=_metadata(settings, request_id),
        )
    except grpc.RpcError as e:
        raise FarmError(f"{e.code().name}: {e.details()}") from None
    return list(reply.candidates)


def fetch(
    request: pb.CompileRequest,
    settings: ClientSettings,
    on_progress: Callable[[pb.Progress], None] | None = None,
    request_id: str = "",
) -> tuple[pb.ArtifactHeader, bytes]:
    """Send one graph; returns the header and the artifact bytes (digest verified).
    `request_id` appears in the gateway's and the worker's log lines for this compile."""
    stub = _stub(settings)
    header, chunks = None, []
    try:
        for event in stub.Compile(
            request, timeout=settings.compile_timeout_s, metadata=_metadata(settings, request_id)
        ):
            kind = event.WhichOneof("event")
            if kind == "progress" and on_progress:
                on_progress(event.progress)
            elif kind == "header":
                header = event.header
                if on_progress:
                    on_progress(pb.Progress(stage=pb.Progress.DOWNLOADING))
            elif kind == "chunk":
                chunks.append(event.chunk)
    except grpc.RpcError as e:
        raise FarmError(f"{e.code().name}: {e.details()}") from None
    if header is None:
        raise FarmError("the farm ended the stream without an artifact")
    data = b"".join(chunks)
    if len(data) != header.size or hashlib.sha256(data).hexdigest() != header.digest:
        raise FarmError("artifact failed its digest check; not loading it")
    return header, data


# ---- Signing: the keys this process trusts -----------------------------------------------
_farm_keys: dict[tuple[str, str, str], signing.Verifier] = {}


def verifier(settings: ClientSettings, request_id: str = "") -> signing.Verifier:
    """The keys entries must be signed with: TORCHFARM_VERIFY_KEYS (pinned), else the ones
    the gateway serves, asked once per process over the same authenticated channel."""
    if settings.verify_keys:
        return signing.Verifier.parse(settings.verify_keys)
    farm = (settings.addr, settings.tls_ca, settings.token)
    if farm not in _farm_keys:
        try:
            reply = _stub(settings).Info(
                pb.InfoRequest(),
                timeout=settings.connect_timeout_s + 30,
                metadata=_metadata(settings, request_id),
            )
        except grpc.RpcError as e:
            raise FarmError(f"{e.code().name}: {e.details()}") from None
        _farm_keys[farm] = signing.Verifier(reply.verify_keys)
    if not _farm_keys[farm]:
        raise UntrustedEntry(
            "the farm publishes no verify key (TORCHFARM_VERIFY_KEYS on its gateway) and this "
            "client pins none: loading nothing from it"
        )
    return _farm_keys[farm]
