"""Drive Inductor: compile a payload into an Artifact (worker child), load one (client)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
from torch._inductor import config as inductor_config

from torchfarm.compiler import files, guards, native, serialize
from torchfarm.proto import torchfarm_pb2 as pb

ARTIFACT_FORMAT = 1
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# Precompiled headers write outside the cache dir and break in a fresh one (seen on 2.13);
# they only save time when many kernels share one header.
_WORKER_CONFIG = {"cpp_cache_precompile_headers": False}
# Loading must not start a compile-worker pool or probe the ISA.
_LOAD_CONFIG = {"cpp_cache_precompile_headers": False, "compile_threads": 1}


def config_patches(options: pb.Options) -> dict:
    """Inductor config patches for a mode plus the user's own (the user's win)."""
    mode = options.mode or "default"
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    patches = dict(torch._inductor.list_mode_options(mode)) if mode != "default" else {}
    # CUDA graphs wrap the loaded code on the client; a loaded artifact runs without them.
    patches.pop("triton.cudagraphs", None)
    if options.config_patches_json:
        user = json.loads(options.config_patches_json)
        if not isinstance(user, dict):
            raise ValueError("config_patches_json must be a JSON object")
        patches.update(user)
    return patches


def compile_payload(payload: bytes, options: pb.Options, threads: int) -> pb.Artifact:
    """Compile a serialized graph with Inductor. Unpickles the payload: run in a sandbox."""
    started = time.perf_counter()
    if threads > 0:
        torch.set_num_threads(threads)
    gm = serialize.loads(payload)
    inputs = serialize.example_inputs(gm)
    fake_mode = torch._guards.detect_fake_mode(inputs)
    objects: dict[str, bytes] = {}
    with (inductor_config.patch(_WORKER_CONFIG),
          torch._guards.tracing(torch._guards.TracingContext(fake_mode)),
          native.capture(objects)):
        compiled = torch._inductor.standalone_compile(
            gm, inputs, dynamic_shapes="from_graph",
            options={"config_patches": config_patches(options)})
    guards_expr = guards.produce(fake_mode.shape_env, inputs)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "artifact.bin")
        compiled.save(path=path, format="binary")
        with open(path, "rb") as f:
            inductor_bytes = f.read()
    return pb.Artifact(
        format=ARTIFACT_FORMAT,
        inductor=inductor_bytes,
        natives=[pb.NativeObject(source_sha256=k, binary=v) for k, v in sorted(objects.items())],
        guards_expr=guards_expr,
        compile_seconds=time.perf_counter() - started,
        op_counts=serialize.op_counts(gm),
    )


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


def load_artifact(artifact: pb.Artifact) -> Callable:
    """Load an Artifact into a callable taking the graph's inputs; compiles no C++."""
    if artifact.format != ARTIFACT_FORMAT:
        raise ValueError(f"artifact format {artifact.format}, this client reads {ARTIFACT_FORMAT}")
    objects = {n.source_sha256: n.binary for n in artifact.natives}
    with _artifact_cache_dir(artifact) as directory:
        path = os.path.join(directory, "artifact.bin")
        if not os.path.exists(path):
            files.write_atomically(path, artifact.inductor)
        with (inductor_config.patch(_LOAD_CONFIG),
              native.provide(objects, os.path.join(directory, "native"))):
            return torch._inductor.CompiledArtifact.load(path=path, format="binary")

