"""Drive Inductor: compile a payload into an Artifact (worker child), load one (client)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config

from torchfarm.compiler import files, guards, native, serialize, trace_state
from torchfarm.proto import torchfarm_pb2 as pb

ARTIFACT_FORMAT = 1
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# Precompiled headers write outside the cache dir and break in a fresh one (seen on 2.13);
# they only save time when many kernels share one header.
_WORKER_CONFIG = {"cpp_cache_precompile_headers": False}
# Compile the backward now, on the farm: by default AOTAutograd lowers it at the first
# backward call (on the client), and torch 2.11 then saves no AOTAutograd entry at all.
_WORKER_FUNCTORCH_CONFIG = {"force_non_lazy_backward_lowering": True}
# Loading must not start a compile-worker pool or probe the ISA.
_LOAD_CONFIG = {"cpp_cache_precompile_headers": False, "compile_threads": 1}


def config_patches(options: pb.Options) -> dict:
    """Inductor config patches for a mode plus the user's own (the user's win)."""
    mode = options.mode or "default"
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    patches = dict(torch._inductor.list_mode_options(mode)) if mode != "default" else {}
    if options.config_patches_json:
        user = json.loads(options.config_patches_json)
        if not isinstance(user, dict):
            raise ValueError("config_patches_json must be a JSON object")
        patches.update(user)
    return patches


def compile_payload(payload: bytes, options: pb.Options, threads: int,
                    size_hints: dict[str, int] | None = None) -> pb.Artifact:
    """Compile a serialized graph with Inductor. Unpickles the payload: run in a sandbox."""
    started = time.perf_counter()
    if threads > 0:
        torch.set_num_threads(threads)
    gm = serialize.loads(payload, size_hints)
    inputs = serialize.example_inputs(gm)
    fake_mode = torch._guards.detect_fake_mode(inputs)
    objects: dict[str, bytes] = {}
    with (inductor_config.patch(_WORKER_CONFIG), functorch_config.patch(_WORKER_FUNCTORCH_CONFIG),
          torch._guards.tracing(torch._guards.TracingContext(fake_mode)),
          trace_state.applied(options.state),
          native.capture(objects), _AutogradCacheLog() as cache_log):
        compiled = torch._inductor.standalone_compile(
            gm, inputs, dynamic_shapes="from_graph",
            options={"config_patches": config_patches(options)})
    guards_expr = guards.produce(fake_mode.shape_env, inputs)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "artifact.bin")
        try:
            compiled.save(path=path, format="binary")
        except RuntimeError as e:  # not saveable: say why AOTAutograd did not cache it
            raise RuntimeError(f"Inductor compiled the graph but cannot save it: "
                               f"{'; '.join(cache_log.messages) or e}") from e
        with open(path, "rb") as f:
            inductor_bytes = f.read()
    return pb.Artifact(
        format=ARTIFACT_FORMAT,
        inductor=inductor_bytes,
        natives=[pb.NativeObject(source_sha256=k, binary=v) for k, v in sorted(objects.items())],
        guards_expr=guards_expr,
        compile_seconds=time.perf_counter() - started,
        op_counts=serialize.op_counts(gm),
        graph_code=gm.code,
        kernels=_kernels(inductor_bytes),
    )


# `name = async_compile.kind(..., '''source'''`: how Inductor's wrapper code defines a kernel.
_KERNEL_DEFINITION = re.compile(
    rb"\b((?:triton|cpp)_\w+) = async_compile\.(\w+)\(.*?'''(.*?)'''", re.S)


def _kernels(inductor_bytes: bytes) -> list[pb.Kernel]:
    """The kernels the artifact's wrapper code defines: names as Inductor gave them, and the
    size of each one's source."""
    found = {}
    for name, kind, source in _KERNEL_DEFINITION.findall(inductor_bytes):
        found.setdefault(name, pb.Kernel(name=name.decode(), kind=kind.decode(),
                                         source_bytes=len(source)))
    return list(found.values())


class _AutogradCacheLog(logging.Handler):
    """Collects why AOTAutograd bypassed its cache: an artifact is saved from that cache."""

    _LOGGER = "torch._functorch._aot_autograd.autograd_cache"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Bypassing" in message or "unable to" in message:
            self.messages.append(message[:2000])

    def __enter__(self) -> _AutogradCacheLog:
        logger = logging.getLogger(self._LOGGER)
        self._saved_level = logger.level
        logger.addHandler(self)
        logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger(self._LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self._saved_level)


@contextlib.contextmanager
def _artifact_cache_dir(artifact: pb.Artifact) -> Iterator[str]:
    """An Inductor cache dir that holds this artifact alone, reused when it loads again.

    `CompiledArtifact.load` looks the graph up in the local FX cache with its shape guards
    switched off, so the first entry under the graph's key wins. Two artifacts of one
    dynamic graph (say batch <= 4096 and batch > 4096) share that key: loaded into one
    directory, the second would silently run the first one's code.
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    digest = hashlib.sha256(artifact.inductor).hexdigest()
    directory = os.path.join(cache_dir(), "torchfarm", digest[:32])
    saved = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    try:
        yield directory
    finally:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


def load_artifact(artifact: pb.Artifact, cudagraphs: bool = False) -> Callable:
    """Load an Artifact into a callable taking the graph's inputs; compiles no C++.

    `cudagraphs` (reduce-overhead, max-autotune): the client records and replays CUDA graphs
    (Inductor's cudagraph trees) around the loaded code, as a local compile would.
    """
    if artifact.format != ARTIFACT_FORMAT:
        raise ValueError(f"artifact format {artifact.format}, this client reads {ARTIFACT_FORMAT}")
    objects = {n.source_sha256: n.binary for n in artifact.natives}
    with _artifact_cache_dir(artifact) as directory:
        path = os.path.join(directory, "artifact.bin")
        if not os.path.exists(path):
            files.write_atomically(path, artifact.inductor)
        with (inductor_config.patch(_LOAD_CONFIG),
              native.provide(objects, os.path.join(directory, "native")),
              _post_compile_cudagraphs(cudagraphs)):
            return torch._inductor.CompiledArtifact.load(path=path, format="binary")


@contextlib.contextmanager
def _post_compile_cudagraphs(enabled: bool) -> Iterator[None]:
    """Make `CompiledArtifact.load` run Inductor's cudagraph post-compile step.

    The loader hard-codes `cudagraphs=BoxedBool(False)` in the post-compile kwargs; the
    artifact itself was compiled with `triton.cudagraphs` on, so it carries what cudagraph
    trees need. Patch the one name the loader builds that flag from.
    """
    if not enabled:
        yield
        return
    from torch._inductor.utils import BoxedBool

    # The module, not the function of the same name that torch._inductor exports.
    loader = importlib.import_module("torch._inductor.standalone_compile")

    saved = loader.BoxedBool
    loader.BoxedBool = lambda _value: BoxedBool(True)
    try:
        with inductor_config.patch({"triton.cudagraphs": True}):
            yield
    finally:
        loader.BoxedBool = saved

