"""The Triton bundle's load is timed while entered, and Inductor's own method comes back."""

import pytest
from torch._inductor.triton_bundler import TritonBundler

from torchfarm.torch_adapter.load import triton_bundle


def test_emitting_a_bundle_is_timed_and_still_runs_torchs_own_code(monkeypatch):
    emitted = []
    monkeypatch.setattr(TritonBundler, "read_and_emit", staticmethod(emitted.append))
    patched = TritonBundler.__dict__["read_and_emit"]
    timings: dict[str, float] = {}
    with triton_bundle.timed(timings):
        TritonBundler.read_and_emit("forward")  # called through the class, as Inductor does
        TritonBundler.read_and_emit("backward")
    assert emitted == ["forward", "backward"]
    assert timings["load_triton_s"] >= 0 and list(timings) == ["load_triton_s"]
    assert TritonBundler.__dict__["read_and_emit"] is patched  # restored as it was


def test_a_failing_emit_is_timed_and_raises(monkeypatch):
    def fail(bundle):
        raise OSError("disk full")

    monkeypatch.setattr(TritonBundler, "read_and_emit", staticmethod(fail))
    timings: dict[str, float] = {}
    with triton_bundle.timed(timings), pytest.raises(OSError, match="disk full"):
        TritonBundler.read_and_emit(None)
    assert "load_triton_s" in timings
