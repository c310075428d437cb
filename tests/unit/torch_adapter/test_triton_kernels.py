"""A compile's Triton kernels recorded once each, and a kernel's tuning result admitted only
within the tuner's range (the pool's build of a recorded kernel, and a later compile finding
it: tests/integration/torch_adapter/test_triton_kernels.py)."""

import json

import pytest

pytest.importorskip("triton")

from tests.unit.torch_adapter.recorded_triton_kernels import KERNELS, NAME  # noqa: E402
from torchfarm.proto import torchfarm_pb2 as pb  # noqa: E402
from torchfarm.workers import kernel_cache  # noqa: E402


def test_recording_hears_each_kernel_once(monkeypatch):
    from torch._inductor import async_compile

    monkeypatch.setattr(async_compile.AsyncCompile, "triton", lambda self, n, s, *a: n)
    recorded = pb.KernelFiles()
    with kernel_cache.recording(recorded, triton=True):
        for _ in range(2):
            assert async_compile.AsyncCompile().triton(NAME, KERNELS[NAME]) == NAME
    assert [(s.kernel_name, s.module) for s in recorded.triton_sources] == [(NAME, KERNELS[NAME])]
    with kernel_cache.recording(recorded):  # a CPU pool's child records no Triton kernel
        async_compile.AsyncCompile().triton("other", "source")
    assert len(recorded.triton_sources) == 1


def _result(**fields) -> bytes:
    """A coordinate-descent result for NAME's kernel (its configs: XBLOCK 1, 4 warps, 1 stage)."""
    from torch._inductor.runtime.triton_heuristics import hash_configs
    from triton import Config

    configs_hash = hash_configs([Config({"XBLOCK": 1}, num_warps=4, num_stages=1)])
    base = {"XBLOCK": 2, "num_warps": 4, "num_stages": 1, "found_by_coordesc": True}
    return json.dumps({**base, "configs_hash": configs_hash, **fields}).encode()


def test_a_result_is_admissible_only_within_the_tuners_range():
    from torchfarm.torch_adapter.worker.triton_kernels import admissible

    assert admissible(_result()) == json.loads(_result())
    assert admissible(_result(R0_BLOCK=65536, time_taken_ms=12.5)) is not None
    for forged in (
        _result(XBLOCK=3),  # not a power of two
        _result(XBLOCK=8192),  # past Inductor's limit for X
        _result(XBLOCK=True),
        _result(num_warps=64),
        _result(num_stages=0),
        _result(extra_options={"x": 1}),  # 2.15 would build any extra option verbatim
        _result(EVIL=1),
        _result(configs_hash=None),
        b"[1, 2]",
        b"not json",
    ):
        assert admissible(forged) is None, forged
