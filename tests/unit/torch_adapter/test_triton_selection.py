"""A compiled graph's Triton bundle keeps exactly the kernels its output code launches, each
with only the files a load reads: a synthetic Triton cache dir, bundled by torch's own
TritonBundler, selected against an output code written as Inductor writes it (kernels
recorded on an H100), then emitted by torch's own loader into an empty cache dir."""

import json
import os
import types

import pytest
from torch._inductor import config
from torch._inductor.output_code import CompiledFxGraph
from torch._inductor.triton_bundler import StaticallyLaunchedAutotuner, TritonBundle, TritonBundler

from tests.unit.torch_adapter.recorded_triton_kernels import KERNELS
from torchfarm.torch_adapter.compile import triton_selection

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
    """A statically launchable autotuner whose configs' binaries are in `hashes`."""
    results = [types.SimpleNamespace(kernel=types.SimpleNamespace(hash=h)) for h in hashes]
    return StaticallyLaunchedAutotuner(
        f"key-{name}", name, types.SimpleNamespace(compile_results=results)
    )


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
