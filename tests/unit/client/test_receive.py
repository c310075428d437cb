"""The client's side of the wire: an artifact arriving as stored (zstd) is decompressed as
its chunks arrive, never past the size its header gives, and checked before it is used."""

import hashlib

import pytest
import zstandard

from torchfarm.client.remote import FarmError, _Decoder
from torchfarm.proto import torchfarm_pb2 as pb

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
