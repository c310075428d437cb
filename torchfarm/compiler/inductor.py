"""Drive Inductor: compile a payload into an Artifact (worker child), load one (client)."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping

import torch

from torchfarm.compiler import descriptor as graph_descriptor
from torchfarm.compiler import files, guards, native, serialize, structure, trace_state
from torchfarm.compiler.compilers import CompileContext
from torchfarm.contract import modes
from torchfarm.errors import NotSaveable
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.compile import (
    autotune_progress,
    light_wrapper,
    standalone,
    triton_selection,
    tuning_devices,
)
from torchfarm.torch_adapter.compile.autograd_cache_log import AutogradCacheLog
from torchfarm.torch_adapter.load import (
    autotune_results,
    debug_flags,
    decompositions,
    device_remap,
    graph_import,
    triton_bundle,
)
from torchfarm.torch_adapter.load.cudagraphs_on_load import cudagraphs_on_load
from torchfarm.torch_adapter.trace import fake_tensors, static_inputs
from torchfarm.torch_adapter.trace.shape_env import ShapeEnv
from torchfarm.torch_adapter.worker import precompiled_headers

# 2: guards as a ShapeGuards tree, not Python text (issue 17); 3: `inductor` holds AOTAutograd's
# bundled entry, loaded from memory (issue 19), not a CompiledArtifact file
ARTIFACT_FORMAT = 3

# Precompiled C++ headers: on once the worker has built them for all its children, which it
# says in their environment (workers/toolchain.py); a child would otherwise build its own.
# Autotune Triton kernels at compile time, on the worker's GPU, so that the results travel in
# the artifact and a client's first call tunes nothing (see `_autotune_results_here`).
# torch 2.13's standalone_compile switches it on itself; set here for every supported torch.
# Ship the Triton kernels the output code launches: their binaries and statically launchable
# autotuners go into the artifact (TritonBundler), so a GPU hit runs no Triton compile, no
# ptxas and no launcher build (torch_adapter/load/triton_bundle.py); both are torch's defaults
# outside fbcode, set here so that no environment variable turns them off. Benchmarked
# candidates and build stages stay out (torch_adapter/compile/triton_selection.py).
WORKER_CONFIG = {
    "cpp_cache_precompile_headers": precompiled_headers.enabled_here(),
    "triton.autotune_at_compile_time": True,
    "bundle_triton_into_fx_graph_cache": True,
    "use_static_cuda_launcher": True,
}
# Compile the backward now, on the farm: by default AOTAutograd lowers it at the first
# backward call (on the client), and torch 2.11 then saves no AOTAutograd entry at all.
_WORKER_FUNCTORCH_CONFIG = {"force_non_lazy_backward_lowering": True}
# Loading must not start a compile-worker pool or probe the ISA, and must unpack the Triton
# kernels the artifact carries and launch them statically, whatever the user's environment.
_LOAD_CONFIG = {
    "cpp_cache_precompile_headers": False,
    "compile_threads": 1,
    "bundle_triton_into_fx_graph_cache": True,
    "use_static_cuda_launcher": True,
}


def config_patches(options: pb.Options) -> dict:
    """Inductor config patches for a mode plus the user's own (the user's win)."""
    mode = modes.checked(options.mode)
    patches = standalone.mode_options(mode) if mode != modes.DEFAULT else {}
    if options.config_patches_json:
        user = json.loads(options.config_patches_json)
        if not isinstance(user, dict):
            raise ValueError("config_patches_json must be a JSON object")
        patches.update(user)
    return patches


def compile_payload(
    payload: bytes,
    options: pb.Options,
    threads: int,
    hints: Mapping[str, int | float] | None = None,
    on_stage: Callable[[pb.Progress.Stage.ValueType], None] | None = None,
    tuning_gpus: tuple[str, ...] = (),
    descriptor: bytes = b"",
) -> pb.Artifact:
    """Compile a serialized graph with Inductor. Unpickles the payload: run in a sandbox.
    With a `descriptor` (the key's), only the graph that has it is compiled
    (compiler/descriptor.py; descriptor.Mismatch otherwise).
    `on_stage(AUTOTUNING)` / `on_stage(COMPILING)` (Progress.Stage) mark where benchmarking
    starts and ends. With two or more `tuning_gpus`, max-autotune benchmarks its candidates
    on all of them at once (torch_adapter/compile/tuning_devices.py)."""
    started = time.perf_counter()
    if threads > 0:
        torch.set_num_threads(threads)
    gm = (
        graph_descriptor.verified(payload, hints or {}, descriptor)
        if descriptor
        else serialize.loads(payload, hints)
    )
    graph_structure = structure.digest(gm)  # before compiling, which may rewrite the graph
    inputs = serialize.example_inputs(gm)
    # A graph without tensor inputs (sizes in, new tensors out) has no fake mode to find.
    fake_mode = fake_tensors.detect_fake_mode(inputs) or fake_tensors.FakeTensorMode(
        shape_env=serialize.shape_env_of(inputs) or ShapeEnv()
    )
    objects: dict[str, bytes] = {}
    with (
        standalone.inductor_config.patch(WORKER_CONFIG),
        standalone.functorch_config.patch(_WORKER_FUNCTORCH_CONFIG),
        fake_tensors.tracing(fake_mode),
        trace_state.applied(options.state),
        native.capture(objects),
        autotune_progress.reporting(on_stage),
        autotune_results.coordesc_results_kept(),
        tuning_devices.spread_over(tuning_gpus),
        triton_selection.only_launched(autotune_results.filed_result),
        static_inputs.declared(serialize.static_inputs(gm)),
        AutogradCacheLog() as cache_log,
    ):
        try:
            compiled = standalone.compile_graph(gm, inputs, config_patches(options))
        except NotSaveable as e:  # say why AOTAutograd did not cache it
            raise RuntimeError(
                "Inductor compiled the graph but cannot save it: "
                f"{'; '.join(cache_log.messages) or e}"
            ) from e
    shape_guards = guards.produce(fake_mode.shape_env or ShapeEnv(), inputs)
    # A client's load then imports less of Inductor (torch_adapter/compile/light_wrapper.py).
    lighter = light_wrapper.lightened(compiled, decompositions.select_decomp_table)
    inductor_bytes = standalone.save(lighter)
    return pb.Artifact(
        format=ARTIFACT_FORMAT,
        inductor=inductor_bytes,
        natives=[pb.NativeObject(source_sha256=k, binary=v) for k, v in sorted(objects.items())],
        guards=shape_guards,
        compile_seconds=time.perf_counter() - started,
        op_counts=serialize.op_counts(gm),
        graph_code=gm.code,
        kernels=_kernels(inductor_bytes),
        tuned_configs=_tuned_configs(),
        structure=graph_structure,
        torch_key=standalone.torch_key(),
    )


class InductorCompiler:
    """Options.compiler "" / "inductor": a Dynamo graph payload into Artifact.inductor."""

    def compile(self, request: pb.CompileChildRequest, context: CompileContext) -> pb.Artifact:
        return compile_payload(
            request.graph,
            request.options,
            request.target.threads,
            dict(request.size_hints) | dict(request.float_hints),
            context.on_stage,
            context.tuning_gpus,
            request.descriptor,
        )


# `name = async_compile.kind(..., '''source'''`: how Inductor's wrapper code defines a kernel.
_KERNEL_DEFINITION = re.compile(
    rb"\b((?:triton|cpp)_\w+) = async_compile\.(\w+)\(.*?'''(.*?)'''", re.S
)


def _tuned_configs() -> dict[str, bytes]:
    """The autotune results in this process's Inductor cache dir, by `<2 chars>/<name>`.

    Inductor records a kernel's first result in the artifact; under max-autotune, coordinate
    descent then finds a better config and rewrites only the file. The files are final.
    """
    found: dict[str, bytes] = {}
    for path in glob.glob(os.path.join(standalone.cache_dir(), "*", "*.best_config")):
        with open(path, "rb") as f:
            found[os.path.join(*path.split(os.sep)[-2:])] = f.read()
    return found


def _kernels(inductor_bytes: bytes) -> list[pb.Kernel]:
    """The kernels the artifact's wrapper code defines: names as Inductor gave them, and the
    size of each one's source."""
    found: dict[bytes, pb.Kernel] = {}
    for name, kind, source in _KERNEL_DEFINITION.findall(inductor_bytes):
        found.setdefault(
            name, pb.Kernel(name=name.decode(), kind=kind.decode(), source_bytes=len(source))
        )
    return list(found.values())


@contextlib.contextmanager
def _artifact_cache_dir(artifact: pb.Artifact, device_index: int | None = None) -> Iterator[str]:
    """The Inductor cache dir of this artifact alone on this device, reused when it loads
    again.

    The artifact itself loads from memory; what Inductor's loader must still write lands
    here, once: the output code's Python module (imported from a file), the C++ libraries
    (`dlopen` needs a file) and, on a GPU, the Triton kernel binaries (the static launcher
    loads a cubin from a path) with the worker's autotune results for them. One dir per
    CUDA device: the output code, rewritten for the caller's device, is written under its
    graph's key only where no file is yet, so ranks sharing a machine's cache dir would
    otherwise import the first rank's code, for its device.
    """
    digest = hashlib.sha256(artifact.inductor).hexdigest()[:32]
    on = f"-cuda{device_index}" if device_index else ""  # None and 0: as compiled
    directory = os.path.join(standalone.cache_dir(), "torchfarm", digest + on)
    with standalone.cache_dir_at(directory):
        yield directory


def load_artifact(
    artifact: pb.Artifact,
    cudagraphs: bool = False,
    device_index: int | None = None,
    timings: dict[str, float] | None = None,
) -> Callable:
    """Load an Artifact into a callable taking the graph's inputs; compiles no C++.

    `cudagraphs` (reduce-overhead, max-autotune): the client records and replays CUDA graphs
    (Inductor's cudagraph trees) around the loaded code, as a local compile would.
    `device_index`: the caller's CUDA device (serialize.local_device_index), where code
    compiled for the canonical device 0 is made to run (None or 0: as compiled).
    `timings` gets where the load's time went: `load_native_s` (C++ libraries written and
    loaded) and `load_triton_s` (Triton binaries written, static launchers loaded).
    """
    if artifact.format != ARTIFACT_FORMAT:
        raise ValueError(f"artifact format {artifact.format}, this client reads {ARTIFACT_FORMAT}")
    objects = {n.source_sha256: n.binary for n in artifact.natives}
    spent = timings if timings is not None else {}
    debug_flags.provide()  # the loaded graphs' calls read Inductor's debug flags
    with (
        _artifact_cache_dir(artifact, device_index) as directory,
        standalone.inductor_config.patch(_LOAD_CONFIG),
        native.provide(objects, os.path.join(directory, "native"), spent),
        triton_bundle.timed(spent),
        _autotune_results_here(directory, artifact.tuned_configs),
        cudagraphs_on_load(cudagraphs),
        device_remap.on_device(device_index),
        graph_import.left_out(),
    ):
        return standalone.load(artifact.inductor)


@contextlib.contextmanager
def _autotune_results_here(directory: str, tuned: Mapping[str, bytes]) -> Iterator[None]:
    """Make the artifact's Triton kernels use the autotune results it carries.

    The worker's final results (`tuned`) are written under `directory`, as
    `<2 chars>/<hash>.best_config` like on the worker, and win over the first ones that
    Inductor recorded in its own artifact (see torch_adapter/load/autotune_results.py).
    """
    written = set()
    for name, data in tuned.items():
        if _is_tuned_config_name(name):
            files.write_atomically(os.path.join(directory, name), data)
            written.add(name)
    with autotune_results.worker_results_win(directory, written):
        yield


_TUNED_CONFIG_NAME = re.compile(r"\w{2}/\w+\.best_config")


def _is_tuned_config_name(name: str) -> bool:
    """`<2 chars>/<hash>.best_config` and nothing else: the names come from the network."""
    return _TUNED_CONFIG_NAME.fullmatch(name) is not None
