"""load_prewarm.known_torch_key: a load takes the worker's torch_key instead of hashing torch's
sources, unless this process has one (or the artifact carries none)."""

import pytest
from torch._inductor.codecache import torch_key

from torchfarm.torch_adapter.load import load_prewarm


@pytest.fixture
def no_torch_key(monkeypatch):
    """Inductor's torch_key unset, and hashing torch's sources a failure; restored after."""
    from torch._inductor import codecache

    def hashed(*args, **kwargs):
        raise AssertionError("torch's sources were hashed")

    torch_key.clear()
    monkeypatch.setattr(codecache, "build_code_hash", hashed)
    yield
    torch_key.clear()


def test_the_workers_key_is_taken_and_nothing_is_hashed(no_torch_key):
    load_prewarm.known_torch_key(b"k" * 32)
    assert torch_key() == b"k" * 32


def test_a_key_this_process_has_is_kept(no_torch_key):
    load_prewarm.known_torch_key(b"a" * 32)
    load_prewarm.known_torch_key(b"b" * 32)
    assert torch_key() == b"a" * 32


def test_an_artifact_without_a_key_leaves_inductor_to_hash(no_torch_key):
    load_prewarm.known_torch_key(b"")
    with pytest.raises(AssertionError, match="hashed"):
        torch_key()
