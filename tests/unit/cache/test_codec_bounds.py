"""Decoding a blob holds one chunk at a time and never more than the entry's recorded size:
a blob that inflates enormously (300 MB of zeros is 30 KB stored) costs a hit one chunk."""

import pytest

from torchfarm.cache.artifacts import Codec, digest_of

ZEROS = bytes(64 << 20)


def test_a_highly_compressed_blob_is_verified_and_decoded_in_bounded_chunks():
    codec = Codec()
    stored = codec.encode(ZEROS)
    assert len(stored) < 64 << 10
    assert codec.verify(stored, digest_of(ZEROS), len(ZEROS))
    sizes = [len(piece) for piece in codec.chunks(stored, len(ZEROS), 1 << 20)]
    assert max(sizes) <= 1 << 20 and sum(sizes) == len(ZEROS)


def test_a_blob_that_decodes_past_its_recorded_size_is_refused_early():
    codec = Codec()
    stored = codec.encode(ZEROS)
    assert not codec.verify(stored, digest_of(ZEROS), 1 << 20)
    pieces = codec.chunks(stored, 1 << 20, 1 << 20)
    next(pieces)
    with pytest.raises(ValueError, match="more than its recorded"):
        next(pieces)
    assert codec.decode(stored, digest_of(ZEROS), 1 << 20) is None
