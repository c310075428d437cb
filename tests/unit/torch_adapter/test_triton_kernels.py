"""A pool's Triton build, then a later compile that finds what it built: the builder child
compiles a kernel module a shared job's child recorded (Triton's bundled ptxas: no GPU
needed), the worker keeps the entries for the pool, and a compile of the same kernel in
another process gets them from Triton's own lookup, compiling nothing. A hostile module is
refused before it runs, and the builder goes on."""

import os

import pytest

pytest.importorskip("triton")

from tests.unit.torch_adapter.recorded_triton_kernels import KERNELS, NAME  # noqa: E402
from torchfarm.proto import torchfarm_pb2 as pb  # noqa: E402
from torchfarm.workers import kernel_cache  # noqa: E402


def _build(name: str, module: str) -> pb.KernelBuild:
    return pb.KernelBuild(triton=pb.TritonSource(kernel_name=name, module=module))


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


def test_a_pool_build_makes_the_entries_that_a_later_compile_finds(tmp_path, monkeypatch):
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime import triton_helpers

    from torchfarm.settings import WorkerSettings
    from torchfarm.torch_adapter import triton_cache
    from torchfarm.workers import kernel_builder

    planted = tmp_path / "planted"
    hostile = KERNELS[NAME].rstrip("\n") + (
        f"\n    getattr(triton.knobs.os, 'system')('touch {planted}')\n"
    )
    with kernel_builder._Builder(WorkerSettings(sandbox="none")) as builder:
        built = builder.build(_build(NAME, KERNELS[NAME]))
        process = builder.proc
        with pytest.raises(ValueError, match="refused"):
            builder.build(_build(NAME, hostile))
        assert builder.proc is process  # a refusal costs the builder nothing
        again = builder.build(_build(NAME, KERNELS[NAME]))
    assert not planted.exists()
    keys = {name.split("/")[1] for name in built.built}
    assert keys and sorted(built.built) == sorted(
        f"triton/{key}/{NAME}.{suffix}" for key in keys for suffix in ("cubin", "json")
    )
    assert set(again.built) == set(built.built)  # each build from an emptied cache dir

    cache = kernel_cache.KernelCache(str(tmp_path / "kernels"), "toolchain", 1 << 30)
    pool = cache.pool_dir("gpu")
    cache.keep(pool, built)
    staging = tmp_path / "staging"
    staging.mkdir()
    kernel_cache.stage(pool, str(staging))
    own = tmp_path / "own"  # the compile's own Triton cache, as in a child
    monkeypatch.setenv("TRITON_CACHE_DIR", str(own))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    for variable, value in triton_cache.environment(str(staging / "triton")).items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setattr(triton_helpers, "set_driver_to_gpu", lambda: None)  # no GPU here
    module = PyCodeCache.load(KERNELS[NAME])
    getattr(module, NAME).precompile(warm_cache_only=True)  # as Inductor's compile workers do
    for key in keys:  # found: a compile would have written its IRs beside these
        assert sorted(os.listdir(own / key)) == sorted(
            [f"{NAME}.cubin", f"{NAME}.json", f"__grp__{NAME}.json"]
        )
        assert (own / key / f"{NAME}.cubin").read_bytes() == built.built[
            f"triton/{key}/{NAME}.cubin"
        ]
