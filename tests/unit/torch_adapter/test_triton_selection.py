"""A compiled graph's Triton bundle keeps exactly the kernels its output code launches, each
with only the files a load reads: a synthetic Triton cache dir, bundled by torch's own
TritonBundler, selected against an output code written as Inductor writes it (kernels
recorded on an H100), then emitted by torch's own loader into an empty cache dir."""

import glob
import json
import os
import pickle
import types

import pytest
from torch._inductor import config
from torch._inductor.async_compile import CompiledTritonKernels
from torch._inductor.output_code import CompiledFxGraph
from torch._inductor.runtime import triton_heuristics as heuristics
from torch._inductor.runtime.autotune_cache import AutotuneCache
from torch._inductor.runtime.triton_heuristics import CachingAutotuner, StaticTritonCompileResult
from torch._inductor.triton_bundler import StaticallyLaunchedAutotuner, TritonBundle, TritonBundler

from tests.unit.torch_adapter.recorded_triton_kernels import KERNELS
from torchfarm.torch_adapter import gate
from torchfarm.torch_adapter.compile import triton_selection
from torchfarm.torch_adapter.load import autotune_results

NORM = "triton_per_fused_gelu_native_layer_norm_0"
GEMM = "triton_tem_fused_mm_0"  # the template the GEMM autotuning chose
LONG = "triton_poi_fused_" + "add_" * 40 + "7"  # a file name Triton cuts at 150 characters
STAGES = (".source", ".ttir", ".ttgir", ".llir", ".ptx")
NEEDED = (".json", ".cubin")


def _output_code(kernels: list[str]) -> str:
    """The output code of a graph launching `kernels`, as Inductor writes it."""
    defined = "\n".join(
        f"{name} = async_compile.triton({name!r}, '''{KERNELS.get(name, f'def {name}(): pass')}''',"
        " device_str='cuda')"
        for name in kernels
    )
    launches = "\n".join(f"        {name}.run(buf0, 512, stream=stream0)" for name in kernels)
    return (
        "from torch._inductor.async_compile import AsyncCompile\n"
        "async_compile = AsyncCompile()\n"
        f"{defined}\n"
        "async_compile.wait(globals())\n"
        "def call(args):\n"
        "    with torch.cuda._DeviceGuard(0):\n"
        "        # Topologically Sorted Source Nodes: [mm]\n"
        "        extern_kernels.mm(arg0_1, arg1_1, out=buf0)\n"
        f"{launches}\n"
    )


def _cache_entry(directory: str, kernel_hash: str, name: str, extra: tuple = ()) -> None:
    """A kernel's Triton cache entry as Triton 3.6 writes one (stem cut at 150 characters)."""
    stem = name[: triton_selection.NAME_LIMIT]
    entry = os.path.join(directory, kernel_hash)
    os.makedirs(entry)
    children = {}
    for extension in STAGES + NEEDED + extra:
        path = os.path.join(entry, stem + extension)
        with open(path, "w") as f:
            f.write(json.dumps({"name": name}) if extension == ".json" else f"{name}{extension}")
        children[stem + extension] = path
    with open(os.path.join(entry, f"__grp__{stem}.json"), "w") as f:
        json.dump({"child_paths": children}, f)


def _autotuner(name: str, *hashes: str) -> StaticallyLaunchedAutotuner:
    """A statically launchable autotuner whose configs' binaries are in `hashes` (its kernel
    tuned nowhere: no source file to find a result beside)."""
    results = [types.SimpleNamespace(kernel=types.SimpleNamespace(hash=h)) for h in hashes]
    kernel = types.SimpleNamespace(compile_results=results, filename=None, inductor_meta={})
    return StaticallyLaunchedAutotuner(f"key-{name}", name, kernel)


@pytest.fixture
def bundled(tmp_path, monkeypatch):
    """torch's bundle of a max-autotune compile's kernels: the launched ones (two configs of
    the norm, the chosen GEMM, a long name), GEMM candidates, a fusion tried and dropped."""
    built = str(tmp_path / "built")
    monkeypatch.setenv("TRITON_CACHE_DIR", built)
    kernels = {
        "hnorm1": NORM,
        "hnorm2": NORM,
        "hgemm": GEMM,
        "hlong": LONG,
        "hcand1": "triton_mm",
        "hcand2": "triton_mm",
        "hfused": "triton_poi_fused_add_9",
    }
    with config.patch(bundle_triton_into_fx_graph_cache=True, use_static_triton_launcher=False):
        TritonBundler.begin_compile()
        for kernel_hash, name in kernels.items():
            _cache_entry(built, kernel_hash, name, (".hsaco",) if kernel_hash == "hlong" else ())
            TritonBundler.put(kernel_hash, 0)
        bundle, _ = TritonBundler.collect()
    autotuners = [
        _autotuner(NORM, "hnorm1", "hnorm2"),
        _autotuner("triton_poi_fused_add_9", "hfused"),
    ]
    return TritonBundle(bundle.kernel_artifacts, autotuners)


def _emitted(bundle: TritonBundle, directory: str, monkeypatch) -> dict[str, set[str]]:
    """What torch's loader writes of `bundle` into the empty Triton cache dir `directory`:
    file names by kernel hash."""
    monkeypatch.setenv("TRITON_CACHE_DIR", directory)
    with config.patch(bundle_triton_into_fx_graph_cache=True, use_static_triton_launcher=False):
        TritonBundler.read_and_emit(bundle)
    return {h: set(os.listdir(os.path.join(directory, h))) for h in os.listdir(directory)}


def test_only_the_launched_kernels_and_their_needed_files_are_kept(bundled, tmp_path, monkeypatch):
    chosen = triton_selection.selected(bundled, _output_code([NORM, GEMM, LONG]))
    emitted = _emitted(chosen, str(tmp_path / "loaded"), monkeypatch)
    assert set(emitted) == {"hnorm1", "hnorm2", "hgemm", "hlong"}
    for kernel_hash, names in emitted.items():
        stem = (LONG if kernel_hash == "hlong" else GEMM if kernel_hash == "hgemm" else NORM)[:150]
        extra = {f"{stem}.hsaco"} if kernel_hash == "hlong" else set()  # not an NVIDIA stage
        assert names == {f"{stem}.json", f"{stem}.cubin", f"__grp__{stem}.json"} | extra
        # Triton's cache hit reads the files its group lists: they are all there, and the
        # metadata and the binary are among them
        entry = tmp_path / "loaded" / kernel_hash
        children = json.loads((entry / f"__grp__{stem}.json").read_text())["child_paths"]
        assert set(children) == names - {f"__grp__{stem}.json"}
        assert all(
            os.path.isfile(p) and os.path.dirname(p) == str(entry) for p in children.values()
        )
    assert [a.kernel_name for a in chosen.static_autotuners] == [NORM]


def test_tritons_cache_finds_the_metadata_and_binary_of_each_kept_kernel(
    bundled, tmp_path, monkeypatch
):
    """Triton's own cache manager (what a cache hit in `triton.compile` asks) finds each kept
    entry's group with its metadata and binary (where Triton is installed: GPU builds)."""
    cache = pytest.importorskip("triton.runtime.cache")
    chosen = triton_selection.selected(bundled, _output_code([NORM, GEMM]))
    emitted = _emitted(chosen, str(tmp_path / "loaded"), monkeypatch)
    for kernel_hash in emitted:
        stem = GEMM if kernel_hash == "hgemm" else NORM
        group = cache.FileCacheManager(kernel_hash).get_group(f"{stem}.json")
        assert group is not None and set(group) == {f"{stem}.json", f"{stem}.cubin"}


def test_a_kept_autotuner_finds_every_binary_it_loads(bundled, tmp_path, monkeypatch):
    """An autotuner of a launched kernel whose config's entry has a name of its own (what
    Triton named it) still gets that entry: torch skips an autotuner missing a cubin."""
    (autotuner,) = [a for a in bundled.static_autotuners if a.kernel_name == NORM]
    autotuner.kernel.compile_results.append(
        types.SimpleNamespace(kernel=types.SimpleNamespace(hash="hcand1"))
    )
    chosen = triton_selection.selected(bundled, _output_code([NORM]))
    emitted = _emitted(chosen, str(tmp_path / "loaded"), monkeypatch)
    assert set(emitted) == {"hnorm1", "hnorm2", "hcand1"}
    assert "triton_mm.cubin" in emitted["hcand1"]


def test_a_graph_without_triton_kernels_keeps_none(bundled):
    chosen = triton_selection.selected(bundled, _output_code([]))
    assert chosen.kernel_artifacts == [] and chosen.static_autotuners == []


def test_a_compiled_graph_gets_the_selected_bundle_while_entered(bundled):
    graph = CompiledFxGraph.__new__(CompiledFxGraph)
    graph.compiled_fn_runner = None  # what its __del__ reads
    graph.source_code = _output_code([GEMM])
    with triton_selection.only_launched():
        graph.set_triton_bundle(bundled)
    assert [k.kernel_hash for k in graph._triton_bundle.kernel_artifacts] == ["hgemm"]
    graph.set_triton_bundle(bundled)  # left: torch's own method again
    assert graph._triton_bundle is bundled


def test_a_bundle_shaped_otherwise_is_kept_whole_not_a_failed_compile(bundled, caplog):
    odd = TritonBundle(bundled.kernel_artifacts, [StaticallyLaunchedAutotuner("k", NORM, None)])
    graph = CompiledFxGraph.__new__(CompiledFxGraph)
    graph.compiled_fn_runner = None
    graph.source_code = _output_code([NORM])
    with triton_selection.only_launched():
        graph.set_triton_bundle(odd)
    assert graph._triton_bundle is odd
    assert "kept whole" in caplog.text


def test_files_of_unknown_kinds_and_unreadable_groups_are_kept():
    files = {"k.json": b"{}", "k.cubin": b"bin", "k.ptx": b"ptx", "__grp__k.json": b"not json"}
    assert triton_selection.needed_files(files) == {
        "k.json": b"{}",
        "k.cubin": b"bin",
        "__grp__k.json": b"not json",
    }
    assert triton_selection.needed_files({"k.json": b"{}", "k.zebin": b"z"}) == {
        "k.json": b"{}",
        "k.zebin": b"z",
    }


def test_a_name_is_launched_only_as_a_whole_word():
    code = "triton_mm_0.run()\n# Source Nodes: [mm]\nx = triton_poi_fused_add_1"
    assert triton_selection.launched("triton_mm_0", code)
    assert not triton_selection.launched("triton_mm", code)
    assert not triton_selection.launched("triton_poi_fused_add", code)
    assert triton_selection.launched("triton_poi_fused_add_1", code)


# ---- a kernel the worker tuned: its autotuner cut to the config its result names ----------

META = {"coordinate_descent_tuning": True}  # max-autotune's
RESULT = autotune_results.filed_result  # what the worker's compile cuts to (compiler/inductor.py)


class _Config:
    """A triton.Config's fields that the autotune cache reads (CPU builds have no Triton)."""

    def __init__(self, xblock: int) -> None:
        self.kwargs = {"XBLOCK": xblock}
        self.num_warps, self.num_stages = 4, 1


def _result(kernel_hash: str, config_) -> StaticTritonCompileResult:
    """A static compile result as a compile builds one: its binary's hash and raw cubin."""
    kernel = types.SimpleNamespace(hash=kernel_hash, name=NORM, cubin_raw=b"cubin", cubin_path=None)
    return StaticTritonCompileResult(kernel, config_, {"device": 0, "device_type": "cuda"}, META)


def _tuned_autotuner(worker: str, configs: list, hashes: list[str]) -> StaticallyLaunchedAutotuner:
    """The norm's autotuner as torch bundles it: copied before tuning, with every config it
    started from (their raw cubins cleared), its source in the worker's cache dir."""
    kernel = CachingAutotuner.__new__(CachingAutotuner)
    kernel.__dict__.update(
        filename=os.path.join(worker, "ab", "cabcdef.py"),
        inductor_meta=dict(META),
        compile_results=[_result(h, c) for h, c in zip(hashes, configs)],
        launchers=[],
        deterministic_mode=False,
        heuristic_type=heuristics.HeuristicType.POINTWISE,
        size_hints=None,
        device_props=None,
    )
    kernel.prepare_for_caching()
    return StaticallyLaunchedAutotuner(f"key-{NORM}", NORM, kernel)


def _tune(autotuner: StaticallyLaunchedAutotuner, configs: list, best, coordesc=False) -> None:
    """The worker's autotune result, written by torch's own autotune cache."""
    kernel = autotuner.kernel
    cache = AutotuneCache.create(
        kernel.inductor_meta, kernel.filename, heuristics.hash_configs(configs)
    )
    cache.save(best, 10**6, found_by_coordesc=coordesc)


def _with(bundled: TritonBundle, autotuner: StaticallyLaunchedAutotuner) -> TritonBundle:
    """`bundled` with the norm's autotuner replaced by `autotuner`."""
    others = [a for a in bundled.static_autotuners if a.kernel_name != NORM]
    return TritonBundle(bundled.kernel_artifacts, [autotuner, *others])


def _loaded(bundle: TritonBundle, worker: str, client, monkeypatch):
    """What the client makes of `bundle` sent in an artifact with the worker's results: the
    bundle emitted by torch's loader (the names of the autotuners it loaded) and the norm's
    autotuner after the load's recheck, which must compile nothing."""
    data = pickle.dumps(bundle)
    tuned = {}
    for path in glob.glob(os.path.join(worker, "*", "*.best_config")):
        name = os.path.relpath(path, worker)
        (client / name).parent.mkdir(parents=True, exist_ok=True)
        (client / name).write_bytes(open(path, "rb").read())
        tuned[name] = path
    monkeypatch.setenv("TRITON_CACHE_DIR", str(client / "triton"))
    monkeypatch.setattr(CompiledTritonKernels, "_cache", {})
    with config.patch(bundle_triton_into_fx_graph_cache=True, use_static_triton_launcher=True):
        meta = TritonBundler.read_and_emit(pickle.loads(data))
    future = CompiledTritonKernels._cache[f"key-{NORM}"]

    def compile_from_source():
        raise AssertionError("the client compiled the kernel")

    with autotune_results.worker_results_win(str(client), set(tuned)):
        future.static_autotuner.recheck_autotune_cache(compile_from_source)
    return meta.statically_launched_kernel_names, future.static_autotuner


def test_a_tuned_kernel_keeps_only_the_config_its_result_names(bundled, tmp_path, monkeypatch):
    worker = str(tmp_path / "worker")
    configs = [_Config(64), _Config(128)]
    autotuner = _tuned_autotuner(worker, configs, ["hnorm1", "hnorm2"])
    _tune(autotuner, configs, configs[1])
    chosen = triton_selection.selected(
        _with(bundled, autotuner), _output_code([NORM, GEMM]), RESULT
    )
    (cut,) = [a for a in chosen.static_autotuners if a.kernel_name == NORM]
    assert [r.kernel.hash for r in cut.kernel.compile_results] == ["hnorm2"]
    assert [r.kernel.hash for r in autotuner.kernel.compile_results] == ["hnorm1", "hnorm2"]
    assert {k.kernel_hash for k in chosen.kernel_artifacts} == {"hnorm2", "hgemm"}
    # the client loads it statically, and its recheck takes that config without compiling
    names, kernel = _loaded(chosen, worker, tmp_path / "client", monkeypatch)
    assert names == [NORM]
    assert [r.kernel.hash for r in kernel.compile_results] == ["hnorm2"]
    assert kernel.autotune_cache_info["autotune_cache_state"] == "hit"
    if gate.release_tuple() < (2, 13):  # 2.13+ skips the rescaling of a hit itself
        assert kernel.inductor_meta["dynamic_scale_rblock"] is False


def test_a_config_coordinate_descent_found_is_the_one_built_here(bundled, tmp_path, monkeypatch):
    """Coordinate descent found a config after the autotuner was bundled: the static result
    this process built for it replaces the bundled ones (raw cubin cleared), and of the
    kernel's other binaries (the configs it started from, those it tried) none is kept."""
    triton = pytest.importorskip("triton")  # the result names a triton.Config of its own
    worker = str(tmp_path / "worker")
    configs = [triton.Config({"XBLOCK": 64}), triton.Config({"XBLOCK": 128})]
    found = triton.Config({"XBLOCK": 256}, num_warps=8)
    autotuner = _tuned_autotuner(worker, configs, ["hnorm1", "hnorm2"])
    _tune(autotuner, configs, found, coordesc=True)
    bundle = _with(bundled, autotuner)
    with config.patch(bundle_triton_into_fx_graph_cache=True, use_static_triton_launcher=False):
        TritonBundler.begin_compile()
        for kernel_hash in ("hfound", "htried"):  # what coordinate descent built, named alike
            _cache_entry(str(tmp_path / "built"), kernel_hash, NORM)
            TritonBundler.put(kernel_hash, 0)
        tried, _ = TritonBundler.collect()
    bundle = TritonBundle(
        bundle.kernel_artifacts + tried.kernel_artifacts, bundle.static_autotuners
    )
    key = heuristics.triton_config_to_hashable
    built = {(autotuner.kernel.filename, key(found)): _result("hfound", found)}
    chosen = triton_selection.selected(bundle, _output_code([NORM]), RESULT, built)
    (cut,) = chosen.static_autotuners
    assert [r.kernel.hash for r in cut.kernel.compile_results] == ["hfound"]
    assert cut.kernel.compile_results[0].kernel.cubin_raw is None  # TritonBundler has the file
    assert {k.kernel_hash for k in chosen.kernel_artifacts} == {"hfound"}
    names, kernel = _loaded(chosen, worker, tmp_path / "client", monkeypatch)
    assert names == [NORM]
    assert [key(r.config) for r in kernel.compile_results] == [key(found)]


def test_a_kernel_whose_result_names_no_config_at_hand_is_kept_whole(bundled, tmp_path):
    """A result this process did not build (another compile's): the autotuner and every
    binary of its name stay, as before."""
    triton = pytest.importorskip("triton")  # 2.13+ makes a triton.Config of such a result
    worker = str(tmp_path / "worker")
    configs = [triton.Config({"XBLOCK": 64}), triton.Config({"XBLOCK": 128})]
    autotuner = _tuned_autotuner(worker, configs, ["hnorm1", "hnorm2"])
    _tune(autotuner, configs, triton.Config({"XBLOCK": 32}))  # none of its configs
    chosen = triton_selection.selected(_with(bundled, autotuner), _output_code([NORM]), RESULT)
    assert chosen.static_autotuners[0] is autotuner
    assert {k.kernel_hash for k in chosen.kernel_artifacts} == {"hnorm1", "hnorm2"}


def test_a_result_torch_cannot_read_keeps_the_autotuner_whole(bundled, tmp_path):
    worker = str(tmp_path / "worker")
    configs = [_Config(64), _Config(128)]
    autotuner = _tuned_autotuner(worker, configs, ["hnorm1", "hnorm2"])
    _tune(autotuner, configs, configs[1])
    (path,) = glob.glob(os.path.join(worker, "*", "*.best_config"))
    result = json.loads(open(path).read())
    with open(path, "w") as f:  # a result without its warps: torch 2.13+ raises KeyError
        json.dump({k: v for k, v in result.items() if k != "num_warps"}, f)
    chosen = triton_selection.selected(_with(bundled, autotuner), _output_code([NORM]), RESULT)
    assert chosen.static_autotuners[0] is autotuner
    assert {k.kernel_hash for k in chosen.kernel_artifacts} == {"hnorm1", "hnorm2"}


def test_while_entered_the_static_results_built_here_are_kept_as_built(
    bundled, tmp_path, monkeypatch
):
    """The result `_precompile_config` returns goes on to load its binary (a launcher):
    what a graph's bundle is cut to is a copy taken before that, without the raw cubin."""
    triton = pytest.importorskip("triton")
    worker = str(tmp_path / "worker")
    configs = [triton.Config({"XBLOCK": 64}), triton.Config({"XBLOCK": 128})]
    autotuner = _tuned_autotuner(worker, configs, ["hnorm1", "hnorm2"])
    found = triton.Config({"XBLOCK": 256})
    _tune(autotuner, configs, found, coordesc=True)
    returned = _result("hfound", found)
    monkeypatch.setattr(CachingAutotuner, "_precompile_config", lambda self, cfg: returned)
    live = types.SimpleNamespace(filename=autotuner.kernel.filename)  # the tuned autotuner
    graph = CompiledFxGraph.__new__(CompiledFxGraph)
    graph.compiled_fn_runner = None
    graph.source_code = _output_code([NORM])
    with triton_selection.only_launched(RESULT):
        assert CachingAutotuner._precompile_config(live, found) is returned
        returned.kernel.function = 7  # what loading it for a launcher sets
        graph.set_triton_bundle(_with(bundled, autotuner))
    assert CachingAutotuner._precompile_config(live, found) is returned  # left: torch's own
    (cut,) = graph._triton_bundle.static_autotuners
    (kept,) = cut.kernel.compile_results
    assert kept.kernel.hash == "hfound" and kept.kernel.cubin_raw is None
    assert not hasattr(kept.kernel, "function") and returned.kernel.cubin_raw == b"cubin"


def test_precompile_is_wrapped_only_while_entered():
    original = CachingAutotuner._precompile_config
    with triton_selection.only_launched():
        assert CachingAutotuner._precompile_config is not original
    assert CachingAutotuner._precompile_config is original
