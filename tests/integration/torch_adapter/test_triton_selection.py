"""A tuned kernel's bundle, with real Triton binaries: a recorded H100 kernel built for
three configs by Triton's own ptxas (no GPU needed), bundled by torch's TritonBundler with
its statically launchable autotuner, the worker's autotune result written by torch's
autotune cache; the graph's bundle cut while `only_launched` is entered, pickled as the
artifact carries it, emitted into an empty Triton cache dir and loaded by torch's own
loader (every cubin the autotuner names found), and rechecked as a client's load does:
the kernel keeps the config the result names and compiles nothing. (The rules, on
synthetic bundles: tests/unit/torch_adapter/test_triton_selection.py.)"""

import os
import pickle
import shutil

import pytest

triton = pytest.importorskip("triton")

from torch._inductor import codecache, config  # noqa: E402
from torch._inductor.async_compile import CompiledTritonKernels  # noqa: E402
from torch._inductor.output_code import CompiledFxGraph  # noqa: E402
from torch._inductor.runtime import triton_helpers  # noqa: E402
from torch._inductor.runtime.autotune_cache import AutotuneCache  # noqa: E402
from torch._inductor.runtime.runtime_utils import triton_config_to_hashable  # noqa: E402
from torch._inductor.runtime.triton_heuristics import hash_configs  # noqa: E402
from torch._inductor.triton_bundler import TritonBundler  # noqa: E402

from tests.unit.torch_adapter.recorded_triton_kernels import KERNELS, NAME  # noqa: E402
from torchfarm.torch_adapter.compile import triton_selection  # noqa: E402
from torchfarm.torch_adapter.load import autotune_results  # noqa: E402

CONFIGS = [triton.Config({"XBLOCK": x}, num_warps=4, num_stages=1) for x in (1, 2, 4)]
KEY = "static-key"


def _compiled(tmp_path, monkeypatch, best, coordesc: bool) -> CompiledFxGraph:
    """The worker: the kernel built for CONFIGS and its autotuner bundled (before tuning);
    with `coordesc`, `best` built after that (as coordinate descent builds a config); the
    result `best` filed; the graph given its bundle while `only_launched` is entered."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "worker" / "triton"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "worker" / "inductor"))
    monkeypatch.setattr(triton_helpers, "set_driver_to_gpu", lambda: None)  # no GPU here
    graph = CompiledFxGraph.__new__(CompiledFxGraph)
    graph.compiled_fn_runner = None
    graph.source_code = f"{NAME} = async_compile.triton({NAME!r}, '''...''')\n{NAME}.run()\n"
    with (
        config.patch(bundle_triton_into_fx_graph_cache=True, use_static_triton_launcher=True),
        triton_selection.only_launched(autotune_results.filed_result),
    ):
        TritonBundler.begin_compile()
        kernel = getattr(codecache.PyCodeCache.load(KERNELS[NAME]), NAME)
        kernel.compile_results, kernel.launchers, kernel.configs = [], [], list(CONFIGS)
        kernel._precompile_worker()
        TritonBundler.put_static_autotuner(KEY, kernel)
        if coordesc:
            kernel._precompile_config(best)
        cache = AutotuneCache.create(kernel.inductor_meta, kernel.filename, hash_configs(CONFIGS))
        cache.save(best, 10**6, found_by_coordesc=coordesc)
        bundle, _ = TritonBundler.collect()
        assert len(bundle.kernel_artifacts) == len(CONFIGS) + coordesc  # every config built
        graph.set_triton_bundle(bundle)
    return graph


def _loaded(graph: CompiledFxGraph, tmp_path, monkeypatch):
    """The client: the bundle sent, emitted into an empty Triton cache dir, its autotuner
    loaded, and rechecked with the worker's results beside it; (entries emitted, the
    autotuners loaded, the kernel)."""
    bundle = pickle.loads(pickle.dumps(graph._triton_bundle))
    worker, client = tmp_path / "worker" / "inductor", tmp_path / "client"
    for path in worker.glob("*/*.best_config"):  # what Artifact.tuned_configs carries
        (client / path.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, client / path.parent.name / path.name)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(client / "triton"))
    monkeypatch.setattr(CompiledTritonKernels, "_cache", {})
    with config.patch(bundle_triton_into_fx_graph_cache=True, use_static_triton_launcher=True):
        meta = TritonBundler.read_and_emit(bundle)
    kernel = CompiledTritonKernels._cache[KEY].static_autotuner

    def compile_from_source():
        raise AssertionError("the client compiled the kernel")

    tuned = {f"{p.parent.name}/{p.name}" for p in client.glob("*/*.best_config")}
    with autotune_results.worker_results_win(str(client), tuned):
        kernel.recheck_autotune_cache(compile_from_source)
    emitted = {d: sorted(os.listdir(client / "triton" / d)) for d in os.listdir(client / "triton")}
    return emitted, meta.statically_launched_kernel_names, kernel


def _binary(result) -> str:
    from torch._inductor.runtime.runtime_utils import triton_hash_to_path_key

    return triton_hash_to_path_key(result.kernel.hash)


@pytest.mark.parametrize("coordesc", [False, True], ids=["one-of-its-configs", "found-after"])
def test_a_tuned_kernel_ships_and_loads_only_the_config_its_result_names(
    tmp_path, monkeypatch, coordesc
):
    best = triton.Config({"XBLOCK": 8}, num_warps=2, num_stages=1) if coordesc else CONFIGS[1]
    graph = _compiled(tmp_path, monkeypatch, best, coordesc)
    (cut,) = graph._triton_bundle.static_autotuners
    (kept,) = cut.kernel.compile_results
    assert triton_config_to_hashable(kept.config) == triton_config_to_hashable(best)
    assert kept.kernel.cubin_raw is None  # TritonBundler carries the binary
    emitted, loaded, kernel = _loaded(graph, tmp_path, monkeypatch)
    files = [f"__grp__{NAME}.json", f"{NAME}.cubin", f"{NAME}.json"]
    assert emitted == {_binary(kept): files}  # the one binary of the kernel, no build stage
    assert loaded == [NAME]  # statically launchable: its one cubin was there
    (result,) = kernel.compile_results
    assert triton_config_to_hashable(result.config) == triton_config_to_hashable(best)
    assert kernel.autotune_cache_info["autotune_cache_state"] == "hit"
