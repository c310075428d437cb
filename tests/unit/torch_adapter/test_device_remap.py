"""The device remap: code compiled for cuda:0 rewritten for cuda:N, and nothing else."""

import dataclasses
import pickle
import types

import pytest
import torch
from torch._functorch._aot_autograd.aot_autograd_result import GenericAOTAutogradResult
from torch._inductor.async_compile import CompiledTritonKernels
from torch._inductor.codecache import FxGraphCache
from torch._inductor.runtime.hints import DeviceProperties
from torch._inductor.triton_bundler import (
    StaticallyLaunchedAutotuner,
    TritonBundle,
    TritonKernelArtifacts,
)
from torch.utils._ordered_set import OrderedSet

from torchfarm.torch_adapter.load import device_remap

DATA = __import__("pathlib").Path(__file__).parents[2] / "data"
# Output code for CUDA: the forward and backward of a small training graph as torch 2.11's
# Inductor wrote them on an H100 (with compile-time autotuning, as workers compile), and a
# sample in torch 2.13's format that adds the forms that graph lacks.
SAMPLES = sorted(DATA.glob("cuda_output_code_*.txt"))
FORMS = (
    "torch.cuda._DeviceGuard({})",
    "torch.cuda.set_device({})",
    "get_raw_stream({})",
    "device(type='cuda', index={})",
    "DeviceProperties(type='cuda', index={},",
)


@pytest.fixture(params=SAMPLES, ids=[p.stem for p in SAMPLES])
def source(request) -> str:
    return request.param.read_text()


def test_index_0_stays_index_0(source):
    assert device_remap.remap_source(source, 0) == source


def test_every_device_index_in_output_code_becomes_the_callers(source):
    remapped = device_remap.remap_source(source, 3)
    assert all(form.format(0) in source for form in FORMS[::2])  # guard, stream, kernel
    for form in FORMS:
        assert form.format(0) not in remapped
        assert remapped.count(form.format(3)) == source.count(form.format(0))
    # Nothing else changed: every changed line names the device in one of the known forms.
    for before, after in zip(source.splitlines(), remapped.splitlines(), strict=True):
        if before != after:
            assert after == device_remap.remap_source(before, 3)
            assert (
                any(f.format(0) in before for f in FORMS)
                or "cuda:0" in before
                or ("default_generators[0]" in before)
            )


def test_the_samples_hold_every_form():
    texts = [p.read_text() for p in SAMPLES]
    assert len(texts) >= 3
    for form in [*FORMS, "torch.cuda.default_generators[{}]", "'cuda:{}'"]:
        assert any(form.format(0) in text for text in texts), form


def test_output_code_naming_another_device_is_refused(source):
    with pytest.raises(ValueError, match="not device 0"):
        device_remap.remap_source(source.replace("get_raw_stream(0)", "get_raw_stream(1)"), 2)


def _autotuner(cache_key: str) -> StaticallyLaunchedAutotuner:
    props = DeviceProperties(type="cuda", index=0, multi_processor_count=132, cc=90, major=9)
    kernel = types.SimpleNamespace(
        triton_meta={"device": 0, "device_type": "cuda"},
        device_props=props,
        compile_results=[types.SimpleNamespace(compile_meta={"device": 0, "cc": 90})],
    )
    return StaticallyLaunchedAutotuner(cache_key=cache_key, kernel_name="k", kernel=kernel)


def _compiled_graph(source: str) -> types.SimpleNamespace:
    """The fields of a CompiledFxGraph that the remap reads and writes."""
    (first_key, *_) = device_remap._kernel_keys(source)
    return types.SimpleNamespace(
        source_code=source,
        device_idxs=OrderedSet([0]),
        constants={"cpu_constant": torch.ones(2)},
        _triton_bundle=TritonBundle(
            kernel_artifacts=[TritonKernelArtifacts(kernel_hash="h", device=0, artifacts=[])],
            static_autotuners=[_autotuner(first_key), _autotuner("a kernel of no source")],
        ),
    )


def test_a_loaded_graph_and_its_triton_bundle_move_to_the_callers_device(source):
    graph = _compiled_graph(source)
    constant = graph.constants["cpu_constant"]
    device_remap.remap_graph(graph, 2)
    assert graph.source_code == device_remap.remap_source(source, 2)
    assert list(graph.device_idxs) == [2] and graph.constants["cpu_constant"] is constant
    bundle = graph._triton_bundle
    assert [a.device for a in bundle.kernel_artifacts] == [2]
    (static,) = bundle.static_autotuners  # the one whose source is unknown is rebuilt instead
    assert static.cache_key == CompiledTritonKernels.key(
        device_remap._TRITON_KERNEL.findall(graph.source_code)[0][3:-3]
    )
    assert static.kernel.triton_meta["device"] == 2 and static.kernel.device_props.index == 2
    assert static.kernel.compile_results[0].compile_meta == {"device": 2, "cc": 90}


def test_a_graph_compiled_for_another_device_is_refused(source):
    graph = _compiled_graph(source)
    graph.device_idxs = OrderedSet([1])
    with pytest.raises(ValueError, match="device 1"):
        device_remap.remap_graph(graph, 2)


def test_cudagraph_safe_rng_state_moves_too():
    meta = types.SimpleNamespace(
        graphsafe_rng_state_index=0, graphsafe_rng_device=torch.device("cuda", 0)
    )
    device_remap.remap_runtime_metadata(meta, 5)
    assert meta.graphsafe_rng_state_index == 5 and meta.graphsafe_rng_device == torch.device(
        "cuda", 5
    )
    none = types.SimpleNamespace(graphsafe_rng_state_index=None, graphsafe_rng_device=None)
    device_remap.remap_runtime_metadata(none, 5)
    assert none == types.SimpleNamespace(graphsafe_rng_state_index=None, graphsafe_rng_device=None)


def test_loads_inside_the_block_are_rewritten_before_torch_sees_them_and_only_there(
    monkeypatch, source
):
    seen = []
    monkeypatch.setattr(
        FxGraphCache,
        "cache_hit_post_compile",
        staticmethod(lambda graph, info, constants: seen.append(list(graph.device_idxs))),
    )
    monkeypatch.setattr(
        GenericAOTAutogradResult,
        "wrap_post_compile",
        lambda self, args, aot_config, fx_config: seen.append(
            self.runtime_metadata.graphsafe_rng_state_index
        ),
    )
    result = types.SimpleNamespace(
        runtime_metadata=types.SimpleNamespace(graphsafe_rng_state_index=0)
    )
    with device_remap.on_device(4):
        FxGraphCache.cache_hit_post_compile(_compiled_graph(source), {}, None)
        GenericAOTAutogradResult.wrap_post_compile(result, [], None, {})
    FxGraphCache.cache_hit_post_compile(_compiled_graph(source), {}, None)
    with device_remap.on_device(0), device_remap.on_device(None):
        FxGraphCache.cache_hit_post_compile(_compiled_graph(source), {}, None)
    assert seen == [[4], 4, [0], [0]]


def test_frozen_bundle_types_are_replaced_not_mutated(source):
    graph = _compiled_graph(source)
    before = graph._triton_bundle
    device_remap.remap_graph(graph, 1)
    assert before.kernel_artifacts[0].device == 0 and dataclasses.is_dataclass(graph._triton_bundle)


def test_pickled_storages_load_on_the_callers_device_inside_the_block_only(monkeypatch):
    # CUDA constants come out of a cache entry through torch.storage._load_from_bytes, a
    # torch.load without map_location: they would land on cuda:0 (a context on GPU 0).
    data = pickle.dumps(torch.arange(3.0))
    locations = []
    load = torch.load

    def recording_load(*args, **kwargs):
        locations.append(kwargs.get("map_location"))
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    with device_remap.on_device(6):
        inside = pickle.loads(data)
    outside = pickle.loads(data)
    assert torch.equal(inside, outside) and torch.equal(inside, torch.arange(3.0))
    assert locations == [{"cuda:0": "cuda:6"}, None]
