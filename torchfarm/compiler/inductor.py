"""Drive Inductor: compile a payload into an Artifact (worker child), load one (client)."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping

import torch
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from torchfarm.compiler import files, guards, native, serialize, trace_state
from torchfarm.contract.modes import MODES
from torchfarm.proto import torchfarm_pb2 as pb

ARTIFACT_FORMAT = 1

# Precompiled headers write outside the cache dir and break in a fresh one (seen on 2.13);
# they only save time when many kernels share one header.
# Autotune Triton kernels at compile time, on the worker's GPU, so that the results travel in
# the artifact and a client's first call tunes nothing (see `_autotune_results_here`).
# torch 2.13's standalone_compile switches it on itself; set here for every supported torch.
_WORKER_CONFIG = {"cpp_cache_precompile_headers": False, "triton.autotune_at_compile_time": True}
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


def compile_payload(
    payload: bytes,
    options: pb.Options,
    threads: int,
    size_hints: dict[str, int] | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> pb.Artifact:
    """Compile a serialized graph with Inductor. Unpickles the payload: run in a sandbox.
    `on_stage("autotuning")` / `on_stage("compiling")` mark where benchmarking starts and ends."""
    started = time.perf_counter()
    if threads > 0:
        torch.set_num_threads(threads)
    gm = serialize.loads(payload, size_hints)
    inputs = serialize.example_inputs(gm)
    # A graph without tensor inputs (sizes in, new tensors out) has no fake mode to find.
    fake_mode = torch._guards.detect_fake_mode(inputs) or torch._subclasses.FakeTensorMode(
        shape_env=serialize.shape_env_of(inputs) or ShapeEnv()
    )
    objects: dict[str, bytes] = {}
    with (
        inductor_config.patch(_WORKER_CONFIG),
        functorch_config.patch(_WORKER_FUNCTORCH_CONFIG),
        torch._guards.tracing(torch._guards.TracingContext(fake_mode)),
        trace_state.applied(options.state),
        native.capture(objects),
        _reporting_autotuning(on_stage),
        _AutogradCacheLog() as cache_log,
    ):
        compiled = torch._inductor.standalone_compile(
            gm,
            inputs,
            dynamic_shapes="from_graph",
            options={"config_patches": config_patches(options)},
        )
    guards_expr = guards.produce(fake_mode.shape_env, inputs)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "artifact.bin")
        try:
            compiled.save(path=path, format="binary")
        except RuntimeError as e:  # not saveable: say why AOTAutograd did not cache it
            raise RuntimeError(
                f"Inductor compiled the graph but cannot save it: "
                f"{'; '.join(cache_log.messages) or e}"
            ) from e
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
        tuned_configs=_tuned_configs(),
    )


# Where Inductor benchmarks choices: algorithm selection (max-autotune GEMM/conv templates) and
# Triton kernel configs (tuned at compile time on the worker, see _WORKER_CONFIG).
_AUTOTUNING = (
    ("torch._inductor.select_algorithm", "AlgorithmSelectorCache", "do_autotuning"),
    ("torch._inductor.runtime.triton_heuristics", "CachingAutotuner", "benchmark_all_configs"),
)


@contextlib.contextmanager
def _reporting_autotuning(on_stage: Callable[[str], None] | None) -> Iterator[None]:
    """Call `on_stage` around every benchmarking call of Inductor's (outermost only)."""
    if on_stage is None:
        yield
        return
    depth = [0]
    patched = []
    for module, owner_name, method in _AUTOTUNING:
        owner = getattr(importlib.import_module(module), owner_name, None)
        original = getattr(owner, method, None)
        if original is None:  # another torch version: no report, still correct
            continue

        def reporting(*args, _original=original, **kwargs):
            depth[0] += 1
            if depth[0] == 1:
                on_stage("autotuning")
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    on_stage("compiling")

        setattr(owner, method, reporting)
        patched.append((owner, method, original))
    try:
        yield
    finally:
        for owner, method, original in patched:
            setattr(owner, method, original)


# `name = async_compile.kind(..., '''source'''`: how Inductor's wrapper code defines a kernel.
_KERNEL_DEFINITION = re.compile(
    rb"\b((?:triton|cpp)_\w+) = async_compile\.(\w+)\(.*?'''(.*?)'''", re.S
)


def _tuned_configs() -> dict[str, bytes]:
    """The autotune results in this process's Inductor cache dir, by `<2 chars>/<name>`.

    Inductor records a kernel's first result in the artifact; under max-autotune, coordinate
    descent then finds a better config and rewrites only the file. The files are final.
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    found = {}
    for path in glob.glob(os.path.join(cache_dir(), "*", "*.best_config")):
        with open(path, "rb") as f:
            found[os.path.join(*path.split(os.sep)[-2:])] = f.read()
    return found


def _kernels(inductor_bytes: bytes) -> list[pb.Kernel]:
    """The kernels the artifact's wrapper code defines: names as Inductor gave them, and the
    size of each one's source."""
    found = {}
    for name, kind, source in _KERNEL_DEFINITION.findall(inductor_bytes):
        found.setdefault(
            name, pb.Kernel(name=name.decode(), kind=kind.decode(), source_bytes=len(source))
        )
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
        with (
            inductor_config.patch(_LOAD_CONFIG),
            native.provide(objects, os.path.join(directory, "native")),
            _autotune_results_here(directory, artifact.tuned_configs),
            _post_compile_cudagraphs(cudagraphs),
        ):
            return torch._inductor.CompiledArtifact.load(path=path, format="binary")


@contextlib.contextmanager
def _autotune_results_here(directory: str, tuned: Mapping[str, bytes]) -> Iterator[None]:
    """Make the artifact's Triton kernels use the autotune results it carries.

    - The worker's final results (`tuned`) are written under `directory`, as
      `<2 chars>/<hash>.best_config` like on the worker, and win over the first ones that
      Inductor recorded in its own artifact.
    - A Triton kernel comes out of the artifact as a pickled CachingAutotuner that remembers
      where its source lay on the worker, and on load it looks for its `.best_config` beside
      that path, in a directory of the worker's: point it at `directory` first.
    - Torch's recheck then finds no result for a kernel that the worker tuned at compile
      time (see `_tuned_on_worker`), and torch 2.11's ignores one for a kernel with a single
      config, which is what coordinate descent (max-autotune) leaves: the first call would
      tune and compile the kernel again. The recheck used while loading is torch 2.13's,
      with the worker's results found.
    """
    from torch._inductor.runtime import triton_heuristics as heuristics
    from torch._inductor.runtime.autotune_cache import AutotuneCacheArtifact

    for name, data in tuned.items():
        if _is_tuned_config_name(name):
            files.write_atomically(os.path.join(directory, name), data)
    populate = AutotuneCacheArtifact.populate_cache

    def populate_unless_tuned(self):
        if self.key not in tuned:
            populate(self)

    autotuner = heuristics.CachingAutotuner
    original = getattr(autotuner, "recheck_autotune_cache", None)

    def recheck_here(self, reload_kernel_from_src):
        if self.filename:
            self.filename = os.path.join(directory, *self.filename.split(os.sep)[-2:])
        configs = [result.config for result in self.compile_results]
        cached, _, self.autotune_cache_info = heuristics.check_autotune_cache(
            configs, self.filename, self.inductor_meta
        )
        if self.autotune_cache_info.get("autotune_cache_state") == "hit":
            best = cached[0]
        elif (best := _tuned_on_worker(self, configs)) is not None:
            self.autotune_cache_info = {"autotune_cache_state": "hit", "source": "torchfarm"}
        else:
            return
        by_coordesc = getattr(best, "found_by_coordesc", False)
        wanted = heuristics.triton_config_to_hashable(best)
        for result in self.compile_results:
            if heuristics.triton_config_to_hashable(result.config) == wanted:
                result.config.found_by_coordesc = by_coordesc
                self.compile_results = [result]
                return
        # Found by coordinate descent after the kernel was bundled: compile that config.
        if self.fn.fn is None:
            self.fn = reload_kernel_from_src().fn
        self.compile_results = [self._precompile_config(best)]

    AutotuneCacheArtifact.populate_cache = populate_unless_tuned
    if original is not None:  # a torch without statically launched kernels has none
        autotuner.recheck_autotune_cache = recheck_here
    try:
        yield
    finally:
        AutotuneCacheArtifact.populate_cache = populate
        if original is not None:
            autotuner.recheck_autotune_cache = original


def _tuned_on_worker(autotuner, configs: list):
    """The worker's autotune result for this kernel, or None.

    Inductor files a result under a hash of the configs the kernel started from. The worker
    tuned at compile time, so the bundled kernel keeps only the winner, and the hash over
    its configs no longer matches the file's: check the file against its own hash. The file
    was written for this kernel's source in the same compile.
    """
    from torch._inductor.runtime import autotune_cache

    if not autotuner.filename:
        return None
    cache = autotune_cache.AutotuneCache.create(autotuner.inductor_meta, autotuner.filename, "")
    best = cache._read() if cache else None
    if not best:
        return None
    return autotune_cache._load_cached_autotuning(
        best, best.get("configs_hash"), configs, autotuner.inductor_meta
    )


_TUNED_CONFIG_NAME = re.compile(r"\w{2}/\w+\.best_config")


def _is_tuned_config_name(name: str) -> bool:
    """`<2 chars>/<hash>.best_config` and nothing else: the names come from the network."""
    return _TUNED_CONFIG_NAME.fullmatch(name) is not None


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
