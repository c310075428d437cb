"""The pool's kernel builds with g++ (workers/kernel_builder.py): a build names its objects as
the compile that recorded its source did, and one builder child builds a burst, each
source alone (the cache's own logic: tests/unit/workers/; on a farm:
tests/integration/test_kernel_cache.py)."""

import ctypes

import pytest

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.workers import kernel_cache


def test_a_kernel_build_names_its_objects_as_the_compile_that_recorded_its_source(
    tmp_path, monkeypatch
):
    """The pool's build derives the names itself, from the recorded source alone: the same
    names as the compile's own, for a library that works."""
    from torch._inductor import codecache
    from torch._inductor import config as inductor_config

    from torchfarm.compiler.inductor import WORKER_CONFIG
    from torchfarm.workers import kernel_builder

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile"))
    code = 'extern "C" int torchfarm_probe(int x) { return 2 * x + 1; }'
    recorded = pb.KernelFiles()
    with inductor_config.patch(WORKER_CONFIG), kernel_cache.recording(recorded):  # as a child
        assert codecache.CppCodeCache.load(code).torchfarm_probe(20) == 41
    sources = recorded.sources
    assert [s.main_code for s in sources] == [code] and not sources[0].has_optimized
    compiled = kernel_cache.report(str(tmp_path / "compile"), "")
    codecache.CppCodeCache.cache_clear()  # as in the builder's fresh process
    (request,) = kernel_builder.builds_of(recorded)
    built = kernel_builder.build(request, str(tmp_path / "build"))
    assert built.built and set(built.built) <= set(compiled.built)  # + the ISA probe's
    (name,) = built.built
    library = tmp_path / "built.so"  # bytes differ in paths only (debug info): it works
    library.write_bytes(built.built[name])
    assert ctypes.CDLL(str(library)).torchfarm_probe(20) == 41


def test_one_builder_child_builds_a_burst_each_source_alone_and_survives_a_broken_one(
    worker_isa_verdict,
):
    """The pool's builder child takes sources one after another: each build reports only its
    own source's objects (an emptied cache dir, a process forked from an untouched state), a
    source that does not compile fails alone, and the next one starts a builder again."""
    from torchfarm.settings import WorkerSettings
    from torchfarm.workers import kernel_builder

    def source(code: str) -> pb.KernelBuild:
        return pb.KernelBuild(cpp=pb.KernelSource(code_cache="CppCodeCache", main_code=code))

    first = source('extern "C" int torchfarm_first(int x) { return x + 1; }')
    second = source('extern "C" int torchfarm_second(int x) { return x + 2; }')
    broken = source('extern "C" int torchfarm_broken(int x) { return x + ; }')
    # at the compiles' priority, as the tier's farms build (conftest): idle, on a saturated CI
    # box, this burst waited 227 s for CPU (priorities: test_idle_builds.py)
    settings = WorkerSettings(sandbox="none", kernel_build_priority="normal")
    with kernel_builder._Builder(settings) as builder:
        a = set(builder.build(first).built)
        process = builder.proc
        b = set(builder.build(second).built)
        assert builder.proc is process  # one child for the burst
        with pytest.raises(RuntimeError, match="build exit 1"):
            builder.build(broken)
        assert builder.proc is None
        again = set(builder.build(first).built)
    assert a - b and b - a  # neither build reports the other's objects
    assert again == a  # and the first source, built again after a failure, gives the same
