"""The client's side of the wire: an artifact arriving as stored (zstd) is decompressed as
its chunks arrive, never past the size its header gives, and checked before it is used."""

import gc
import hashlib
import threading
import weakref

import grpc
import pytest
import zstandard

from torchfarm.client import remote
from torchfarm.client.remote import FarmError, _Decoder
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings

ARTIFACT = bytes(range(256)) * 4000  # about 1 MB


def _header(data: bytes, encoding: str = "zstd") -> pb.ArtifactHeader:
    return pb.ArtifactHeader(
        digest=hashlib.sha256(data).hexdigest(), size=len(data), encoding=encoding
    )


def _pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("encoding", ["zstd", ""])
def test_chunks_are_decoded_as_they_arrive_and_counted_as_received(encoding):
    wire = zstandard.ZstdCompressor().compress(ARTIFACT) if encoding else ARTIFACT
    decoder = _Decoder(_header(ARTIFACT, encoding))
    for chunk in _pieces(wire, 1000):
        decoder.feed(chunk)
    assert decoder.result() == ARTIFACT
    assert decoder.wire_bytes == len(wire)


def test_a_small_blob_that_inflates_past_the_header_stops_at_once():
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(256 << 20))  # 256 MiB: ~8 KB
    decoder = _Decoder(_header(b"small"))
    with pytest.raises(FarmError, match="exceeds the size"):
        for chunk in _pieces(bomb, 1 << 20):
            decoder.feed(chunk)
    assert decoder.size <= (1 << 20)  # stopped within a block, not after a gigabyte


@pytest.mark.parametrize(
    "wire,header,error",
    [
        (b"not zstd at all", _header(ARTIFACT), "does not decompress"),
        (zstandard.ZstdCompressor().compress(b"other bytes"), _header(b"other byteZ"), "digest"),
        (zstandard.ZstdCompressor().compress(ARTIFACT[:-1]), _header(ARTIFACT), "digest"),
    ],
)
def test_bytes_that_are_not_the_named_artifact_are_refused(wire, header, error):
    decoder = _Decoder(header)
    with pytest.raises(FarmError, match=error):
        decoder.feed(wire)
        decoder.result()


def test_an_unknown_encoding_is_refused():
    with pytest.raises(FarmError, match="unknown artifact encoding"):
        _Decoder(_header(ARTIFACT, "gzip"))


class _Stream(grpc.RpcError):
    """A streaming call as gRPC's is: its events, then itself raised as the RpcError."""

    def __init__(self, *events: pb.CompileEvent):
        self.events = events

    def __iter__(self):
        yield from self.events
        raise self

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self) -> str:
        return "the gateway has no stream free for b; retry later"

    def trailing_metadata(self) -> tuple:
        return ()

    def cancel(self) -> None:
        pass


@pytest.mark.parametrize(
    "events,error",
    [
        ((), "RESOURCE_EXHAUSTED: the gateway has no stream free"),
        ((pb.CompileEvent(chunk=b"bytes"),), "before their header"),
    ],
)
def test_a_failed_streams_error_keeps_nothing_of_its_call(events, error):
    """The call is freed when its error is raised, though the error is kept (to the
    interpreter's exit, maybe: a job's future, an uncaught one's traceback): gRPC's
    finalizer of a call at exit can wait forever on a lock its stopped daemon threads
    hold."""
    stream = _Stream(*events)
    call = weakref.ref(stream)
    gc.disable()  # freed as the error is raised, not by a collection (at exit, maybe)
    try:
        with pytest.raises(FarmError, match=error) as kept:
            remote._receive(stream, ClientSettings(inactivity_timeout_s=60), None)
        del stream
        for thread in threading.enumerate():
            if thread.name == "torchfarm-silence":  # ends once the stream is read
                thread.join()
        assert kept.value and call() is None
    finally:
        gc.enable()
