"""A pool's Triton build, then a later compile that finds what it built: the builder child
compiles a kernel module a shared job's child recorded (Triton's bundled ptxas: no GPU
needed), the worker keeps the entries for the pool, and a compile of the same kernel in
another process gets them from Triton's own lookup, compiling nothing. A hostile module is
refused before it runs, and the builder goes on. (The recording and a result's range:
tests/unit/torch_adapter/test_triton_kernels.py.)"""

import json
import os

import pytest

pytest.importorskip("triton")

from tests.unit.torch_adapter.recorded_triton_kernels import KERNELS, NAME  # noqa: E402
from tests.unit.torch_adapter.test_triton_kernels import _result  # noqa: E402
from torchfarm.proto import torchfarm_pb2 as pb  # noqa: E402
from torchfarm.workers import kernel_cache  # noqa: E402


def _build(name: str, module: str, result: bytes = b"") -> pb.KernelBuild:
    return pb.KernelBuild(triton=pb.TritonSource(kernel_name=name, module=module, result=result))


def test_a_pool_build_makes_the_entries_and_results_that_a_later_compile_finds(
    tmp_path, monkeypatch
):
    from torch._inductor import async_compile
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime import triton_helpers

    from torchfarm.settings import WorkerSettings
    from torchfarm.torch_adapter.worker import triton_cache
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
        tuned = builder.build(_build(NAME, KERNELS[NAME], _result(time_taken_ms=900)))
        forged = builder.build(_build(NAME, KERNELS[NAME], _result(XBLOCK=3)))
    assert not planted.exists()
    by_text = kernel_cache.text_name(NAME, KERNELS[NAME])

    def entries(files: pb.KernelFiles) -> set[str]:
        return {name.split("/")[1] for name in files.built if name.startswith("triton/")}

    keys = entries(built)
    assert keys and sorted(built.built) == sorted(
        f"triton/{key}/{NAME}.{suffix}" for key in keys for suffix in ("cubin", "json")
    )
    # With the result, the build compiles the config it names (another key), and keeps it.
    assert json.loads(tuned.built.pop(by_text)) == json.loads(_result(time_taken_ms=900))
    assert entries(tuned) and entries(tuned) != keys
    assert set(forged.built) == set(built.built)  # a forged result: not taken, not kept

    cache = kernel_cache.KernelCache(str(tmp_path / "kernels"), "toolchain", 1 << 30)
    pool = cache.pool_dir("gpu")
    cache.keep(pool, built)
    tuned.built[by_text] = _result(time_taken_ms=900)
    cache.keep(pool, tuned)
    staging, inductor = tmp_path / "staging", tmp_path / "inductor"
    staging.mkdir()
    kernel_cache.stage(pool, str(staging))
    own = tmp_path / "own"  # the compile's own Triton cache, as in a child
    monkeypatch.setenv("TRITON_CACHE_DIR", str(own))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    for variable, value in triton_cache.environment(str(staging / "triton")).items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setattr(triton_helpers, "set_driver_to_gpu", lambda: None)  # no GPU here

    def compile_as_a_worker_does(self, kernel_name, source_code, *args):
        kernel = getattr(PyCodeCache.load(source_code), kernel_name)
        kernel.precompile(warm_cache_only=True)
        return kernel

    monkeypatch.setattr(async_compile.AsyncCompile, "triton", compile_as_a_worker_does)
    with kernel_cache.looking_up(str(staging), str(inductor)) as lookups:
        kernel = async_compile.AsyncCompile().triton(NAME, KERNELS[NAME])
    assert [r.config.kwargs for r in kernel.compile_results] == [{"XBLOCK": 2}]  # the pool's
    assert list(lookups.found.values()) == [by_text]
    (key,) = entries(tuned)
    assert sorted(os.listdir(own)) == [key]  # found: a compile would have written its IRs too
    assert sorted(os.listdir(own / key)) == sorted(
        [f"{NAME}.cubin", f"{NAME}.json", f"__grp__{NAME}.json"]
    )
    files = kernel_cache.report(str(inductor), str(staging), False, str(own), lookups)
    assert (list(files.reused), files.tuning_reused) == ([f"triton/{key}"], 1)
    assert files.tuning_seconds_saved == 0.9 and not files.built  # a shared job's report
