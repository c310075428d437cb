"""Run an artifact compiled for `cuda:0` on the caller's `cuda:N` (one compile for all ranks).

Payloads name the canonical index 0 (compiler/serialize.py), so Inductor bakes 0 into what it
compiles. Read in the sources of torch 2.11.0, 2.12.1, 2.13.0, 2.14.1 and 2.15.0, the index
lives in:
- the output code's source (`CompiledFxGraph.source_code`): `torch.cuda._DeviceGuard(0)`,
  `torch.cuda.set_device(0)`, `get_raw_stream(0)`, `device(type='cuda', index=0)` (tensor
  constants, empty tensors), `torch.device("cuda:0")`, `torch.cuda.default_generators[0]`,
  and each Triton kernel's `triton_meta` (`DeviceProperties(type='cuda', index=0, ...)`,
  the device its binary is loaded on);
- `CompiledFxGraph.device_idxs` (the device of cudagraph trees) and its tensor `constants`;
- its Triton bundle: `TritonKernelArtifacts.device` (the cache dir `triton/<index>` the
  binaries are unpacked to) and the statically launched kernels: `CachingAutotuner
  .triton_meta["device"]`, `.device_props` and each compile result's `compile_meta["device"]`,
  filed under `CompiledTritonKernels.key(kernel source)`;
- AOTAutograd's runtime metadata: `graphsafe_rng_state_index` / `graphsafe_rng_device`;
- the pickled CUDA tensor constants themselves: unpickling restores their storages on
  cuda:0 (`torch.storage._load_from_bytes`, a `torch.load` without map_location), which
  would make every rank open a CUDA context on GPU 0.

While `on_device(n)` is entered, every graph Inductor loads from its cache
(`FxGraphCache.cache_hit_post_compile`, which both the lookup and the bundled AOTAutograd
path call) and every AOTAutograd entry (`GenericAOTAutogradResult.wrap_post_compile`) is
rewritten from 0 to `n` before anything runs, emits files or loads a binary, and storages
unpickled in the block (process-wide) are restored on cuda:n instead of cuda:0. A statically
launched kernel whose source cannot be matched is dropped: Inductor then builds it from the
rewritten source (correct, slower). An index other than 0 anywhere is refused (ValueError):
such an artifact was not compiled from a canonical payload.

Rewritten too, harmlessly: the output code's benchmark harness and compile-time autotuning
block. Left as compiled: comments, and `CompiledFxGraph._original_gm` (2.13+, a fake-tensor
graph kept only under Inductor's `wrap_inductor_compiled_regions`, off by default), which keeps
cuda:0.
torch 2.15's own rank-agnostic codegen (`torch.compiler.config.compile_on_one_rank`) is not
used: it changes Dynamo's guards and tracing on the client too.

Verified: the names above read in torch 2.11.0, 2.12.1, 2.13.0, 2.14.1 and 2.15.0 (2.12.1
has 2.11's signatures, 2.14.1 those of 2.13 and 2.15); the rewrite hooks are hit by real CPU
loads on all five (tests/integration/test_device_index.py); on an H100 with
torch 2.11 the whole rewrite (0 -> 0) of a real training artifact kept all its statically
launched kernels and ran equal to eager. An index other than 0 was never run (no machine
with two GPUs): bench/gpu/device_index.py checks it where one is.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import re
from collections.abc import Iterator

import torch
import torch.storage
from torch._functorch._aot_autograd.aot_autograd_result import GenericAOTAutogradResult
from torch._inductor.async_compile import CompiledTritonKernels
from torch._inductor.codecache import FxGraphCache
from torch.utils._ordered_set import OrderedSet

from torchfarm.torch_adapter import gate

CANONICAL_INDEX = 0
# The releases whose sources were read for every place listed above. On any other the
# payload keeps the caller's index (no sharing between ranks, nothing remapped).
SUPPORTED = gate.release(gate.installed_version()) in (
    "2.11.0",
    "2.12.1",
    "2.13.0",
    "2.14.1",
    "2.15.0",
)

# Every form in which Inductor's CUDA output code names a device index: (prefix, index, end).
_INDEX_FORMS = tuple(
    re.compile(p)
    for p in (
        r"(torch\.cuda\._DeviceGuard\()(\d+)(\))",
        r"(torch\.cuda\.set_device\()(\d+)(\))",
        r"(get_raw_stream\()(\d+)(\))",
        r"(device\(type='cuda', index=)(\d+)(\))",
        r"(DeviceProperties\(type='cuda', index=)(\d+)(,)",
        r"(torch\.cuda\.default_generators\[)(\d+)(\])",
        r"""(["']cuda:)(\d+)(["'])""",
    )
)
# `name = async_compile.triton('name', '''source''', ...)`: a Triton kernel in output code.
_TRITON_KERNEL = re.compile(r"async_compile\.triton\(\s*'\w+',\s*('''.*?''')", re.S)


def remap_source(source: str, index: int) -> str:
    """Output code `source` with every device index (all 0) turned into `index`."""
    for form in _INDEX_FORMS:

        def to_index(match: re.Match) -> str:
            if int(match.group(2)) != CANONICAL_INDEX:
                raise ValueError(f"output code names {match.group(0)!r}, not device 0")
            return f"{match.group(1)}{index}{match.group(3)}"

        source = form.sub(to_index, source)
    return source


def _kernel_keys(source: str) -> list[str]:
    """The CompiledTritonKernels keys of the Triton kernels that `source` defines, in order."""
    return [
        CompiledTritonKernels.key(ast.literal_eval(literal))
        for literal in _TRITON_KERNEL.findall(source)
    ]


def _check_canonical(value: int) -> None:
    if value != CANONICAL_INDEX:
        raise ValueError(f"artifact names device {value}, not device 0")


def remap_graph(graph, index: int) -> None:
    """Rewrite a loaded CompiledFxGraph (and its Triton bundle) from device 0 to `index`."""
    for i in graph.device_idxs:
        _check_canonical(i)
    old_keys = _kernel_keys(graph.source_code)
    graph.source_code = remap_source(graph.source_code, index)
    new_key = dict(zip(old_keys, _kernel_keys(graph.source_code), strict=True))
    graph.device_idxs = OrderedSet([index] if graph.device_idxs else [])
    if graph.constants:
        target = torch.device("cuda", index)
        graph.constants = {
            k: v.to(target) if isinstance(v, torch.Tensor) and v.is_cuda else v
            for k, v in graph.constants.items()
        }
    bundle = graph._triton_bundle
    if bundle is None:
        return
    for artifacts in bundle.kernel_artifacts:
        _check_canonical(artifacts.device)
    kept = []
    for static in bundle.static_autotuners:
        if static.cache_key not in new_key:
            continue  # Inductor builds it from the rewritten source instead
        kernel = static.kernel
        _check_canonical(kernel.triton_meta["device"])
        kernel.triton_meta["device"] = index
        kernel.device_props = kernel.device_props._replace(index=index)
        for result in kernel.compile_results:
            if result.compile_meta.get("device") is not None:
                result.compile_meta["device"] = index
        kept.append(dataclasses.replace(static, cache_key=new_key[static.cache_key]))
    graph._triton_bundle = dataclasses.replace(
        bundle,
        kernel_artifacts=[dataclasses.replace(a, device=index) for a in bundle.kernel_artifacts],
        static_autotuners=kept,
    )


def remap_runtime_metadata(meta, index: int) -> None:
    """Rewrite AOTAutograd's cudagraph-safe RNG device (ViewAndMutationMeta) to `index`."""
    if meta.graphsafe_rng_state_index is not None:
        _check_canonical(meta.graphsafe_rng_state_index)
        meta.graphsafe_rng_state_index = index
    device = getattr(meta, "graphsafe_rng_device", None)  # absent before 2.13
    if device is not None and device.type == "cuda":
        _check_canonical(device.index or 0)
        meta.graphsafe_rng_device = torch.device("cuda", index)


@contextlib.contextmanager
def on_device(index: int | None) -> Iterator[None]:
    """Make artifacts loaded inside the block run on `cuda:index` (None or 0: unchanged)."""
    if not index:
        yield
        return
    if not SUPPORTED:
        raise ValueError(f"no device remap on torch {gate.installed_version()}")
    with rewriting(index):
        yield


@contextlib.contextmanager
def rewriting(index: int) -> Iterator[None]:
    """Rewrite every graph and AOTAutograd entry loaded inside the block to `index`, even 0
    (the GPU check runs the whole rewrite on a one-GPU machine that way)."""
    post_compile = FxGraphCache.__dict__["cache_hit_post_compile"]
    wrap_post_compile = GenericAOTAutogradResult.wrap_post_compile

    def graph_on_device(graph, cache_info, constants):
        remap_graph(graph, index)
        return post_compile.__func__(graph, cache_info, constants)

    def result_on_device(self, args, aot_config, fx_config):
        remap_runtime_metadata(self.runtime_metadata, index)
        return wrap_post_compile(self, args, aot_config, fx_config)

    load_from_bytes = torch.storage._load_from_bytes
    location = {f"cuda:{CANONICAL_INDEX}": f"cuda:{index}"}

    def storage_on_device(data: bytes):
        return torch.load(io.BytesIO(data), weights_only=False, map_location=location)

    setattr(FxGraphCache, "cache_hit_post_compile", staticmethod(graph_on_device))  # noqa: B010
    setattr(GenericAOTAutogradResult, "wrap_post_compile", result_on_device)  # noqa: B010
    setattr(torch.storage, "_load_from_bytes", storage_on_device)  # noqa: B010
    try:
        yield
    finally:
        setattr(FxGraphCache, "cache_hit_post_compile", post_compile)  # noqa: B010
        setattr(GenericAOTAutogradResult, "wrap_post_compile", wrap_post_compile)  # noqa: B010
        setattr(torch.storage, "_load_from_bytes", load_from_bytes)  # noqa: B010
