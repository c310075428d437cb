"""Bundle with each compiled graph only the Triton kernels its output code launches, and of
each only the files a load reads.

A max-autotune compile builds far more Triton kernels than its output code launches (every
GEMM template candidate it benchmarked, fusions it tried and dropped), and Triton keeps each
kernel's every build stage beside its binary. Inductor's bundle (`TritonBundler.collect`,
attached to the compiled graph by `CompiledFxGraph.set_triton_bundle`) packs them all: an
LLM's entry was 370 MB, 21x its default-mode entry (issue 52). While `only_launched()` is
entered, the bundle a graph gets is `selected` against its output code. Each rule keeps a
superset of what a load reads (where unsure, a file is kept):
- a statically launchable autotuner is kept where the output code names its kernel. Where
  the worker tuned that kernel, it is cut to the one compile result a load takes from the
  worker's autotune result (`result_of`: compiler/inductor.py gives
  torch_adapter/load/autotune_results.filed_result, what the client's recheck picks: the
  artifact carries the same files, `tuned_configs`): one of the configs it was bundled
  with, or one that coordinate descent or the rblock rescaling found after that, built in
  this process (the static compile results `_precompile_config` returns here are kept, as
  built, while entered). A bundled autotuner holds every config it started from (2.11 and
  2.13+: it is copied before tuning), and torch loads it only where every config's cubin is
  there;
- a kernel's cache entry is kept where a kept autotuner loads its binary (torch skips an
  autotuner whose cubin is missing, and the kernel would then compile on the client), or
  where the output code names its kernel as a whole word and no autotuner of that name was
  cut (all configs of one kernel share its name, those coordinate descent tried included; a
  benchmarked template candidate has a name of its own, e.g. `triton_mm`, that the output
  code never mentions). An autotuner left whole keeps every binary of its name, as before;
- of a kept entry's files only Triton's intermediate stages (INTERMEDIATES) are dropped, and
  its group file (`__grp__<name>.json`, Triton's index of the entry) then lists only the
  files kept. A load reads the metadata (`<name>.json`) and the binary: a cache hit in
  `triton.compile` builds its CompiledKernel from the group's files, using the binary and the
  JSON (3.6: `CompiledKernel.__init__`), the static launcher loads the cubin by path, and
  Triton's own `TRITON_STORE_BINARY_ONLY` keeps just these.
torch 2.13+ already leaves out the losing configs' binaries (`TritonBundler.put_winner`) but
not their compile results in the autotuner, which then fails to load (read in the sources:
the kernel compiles from its source on the client); 2.11 bundles every config tried. On a
load the kept result is what the recheck picks, and the kernel is neither tuned nor rescaled
again (2.11: autotune_results._recheck_2_11).

Uses torch._inductor.output_code.CompiledFxGraph.set_triton_bundle (and source_code), the
dataclasses TritonBundle / TritonKernelArtifacts / TritonKernelArtifact /
StaticallyLaunchedAutotuner of torch._inductor.triton_bundler, an autotuner's
compile_results[].kernel.hash / .config, filename and prepare_for_caching,
CachingAutotuner._precompile_config and StaticTritonCompileResult,
runtime_utils.triton_hash_to_path_key (how `reload_cubin_path` finds the cubin) and
triton_config_to_hashable (how the recheck matches a config). Verified on CPU by the unit
tests, on synthetic cache entries bundled and emitted by torch itself: torch 2.11.0 with
triton 3.6.0 and 2.15.0 with triton 3.9.0 (their cache managers find what is kept; a cut
autotuner pickled, loaded by TritonBundler.load_autotuners and rechecked by the client's
recheck), 2.13.0; and on 2.11.0 and 2.15.0 with real binaries (a recorded H100 kernel built
by Triton's ptxas, tests/integration/torch_adapter/test_triton_selection.py). No Triton
kernel was launched.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
from collections.abc import Callable, Hashable, Iterator, Mapping

from torch._inductor.output_code import CompiledFxGraph
from torch._inductor.runtime.runtime_utils import (
    triton_config_to_hashable,
    triton_hash_to_path_key,
)
from torch._inductor.runtime.triton_heuristics import CachingAutotuner, StaticTritonCompileResult
from torch._inductor.triton_bundler import (
    StaticallyLaunchedAutotuner,
    TritonBundle,
    TritonKernelArtifact,
    TritonKernelArtifacts,
)

log = logging.getLogger("torchfarm.worker")  # it runs in the compile child

# Build stages Triton's NVIDIA backend writes before the binary (3.6: source, ttir, ttgir, llir,
# ptx, then cubin); a load reads the binary and the JSON only. Other backends' stages are kept.
INTERMEDIATES = frozenset({".source", ".ttir", ".ttgir", ".llir", ".ptx"})
GROUP_PREFIX = "__grp__"  # Triton's group file: `__grp__<name>.json` with {"child_paths": ...}
NAME_LIMIT = 150  # Triton truncates a kernel's file names to the first 150 characters


def kernel_name(filenames: list[str]) -> str | None:
    """The name of the kernel whose Triton cache entry holds `filenames` (its metadata file
    is `<name>.json`), or None where there is no metadata file."""
    for filename in filenames:
        stem, extension = os.path.splitext(filename)
        if extension == ".json" and not stem.startswith(GROUP_PREFIX):
            return stem
    return None


def launched(name: str, output_code: str) -> bool:
    """Whether the output code names the kernel `name` (a file name: a long name is a
    truncated prefix of the one in the code)."""
    end = "" if len(name) >= NAME_LIMIT else r"\b"
    return re.search(rf"\b{re.escape(name)}{end}", output_code) is not None


def needed_files(files: Mapping[str, bytes]) -> dict[str, bytes]:
    """The files of one kernel's Triton cache entry that a load reads: all but the
    intermediate stages, with its group file listing only those."""
    kept = {n: data for n, data in files.items() if os.path.splitext(n)[1] not in INTERMEDIATES}
    if len(kept) == len(files):
        return dict(files)
    return {
        n: _group_of(data, kept) if n.startswith(GROUP_PREFIX) else data for n, data in kept.items()
    }


def _group_of(group: bytes, kept: Mapping[str, bytes]) -> bytes:
    """A group file whose `child_paths` lists only the files in `kept`; unchanged where it is
    not the JSON Triton writes."""
    try:
        data = json.loads(group)
        children = data["child_paths"]
        data["child_paths"] = {n: p for n, p in children.items() if n in kept}
    except (ValueError, KeyError, TypeError, AttributeError):
        return group
    return json.dumps(data).encode()


# The config a load takes for a bundled autotuner from the worker's autotune result, or None
# (torch_adapter/load/autotune_results.filed_result, given by the compiler that uses both).
ResultOf = Callable[[CachingAutotuner], object]


def selected(
    bundle: TritonBundle,
    output_code: str,
    result_of: ResultOf | None = None,
    built: Mapping[tuple[str, Hashable], object] | None = None,
) -> TritonBundle:
    """`bundle` with only what a load of `output_code` reads; with `result_of`, a tuned
    kernel's autotuner with only the config it names. `built`: the static compile results
    this process built, by kernel source path and config (`only_launched`)."""
    autotuners = []
    cut_names: set[str] = set()
    whole_names: set[str] = set()
    for autotuner in bundle.static_autotuners:
        if not launched(autotuner.kernel_name, output_code):
            continue
        cut = _cut_to_result(autotuner, result_of, built or {}) if result_of else None
        (cut_names if cut is not None else whole_names).add(autotuner.kernel_name[:NAME_LIMIT])
        autotuners.append(cut or autotuner)
    their_binaries = {
        triton_hash_to_path_key(result.kernel.hash)
        for autotuner in autotuners
        for result in autotuner.kernel.compile_results
    }
    only_theirs = cut_names - whole_names
    kernels = []
    for entry in bundle.kernel_artifacts:
        files = {a.filename: a.payload for a in entry.artifacts}
        name = kernel_name(list(files))
        if entry.kernel_hash in their_binaries or (
            name is not None and name not in only_theirs and launched(name, output_code)
        ):
            needed = needed_files(files)
            artifacts = [TritonKernelArtifact(n, data) for n, data in needed.items()]
            kernels.append(TritonKernelArtifacts(entry.kernel_hash, entry.device, artifacts))
    return TritonBundle(kernels, autotuners)


def _cut_to_result(
    autotuner: StaticallyLaunchedAutotuner,
    result_of: ResultOf,
    built: Mapping[tuple[str, Hashable], object],
) -> StaticallyLaunchedAutotuner | None:
    """`autotuner` with only the compile result of the config a load takes from the
    worker's autotune result (`result_of`): one of its configs, or one found after it was
    bundled that this process built statically launchable; None where there is none."""
    kernel = autotuner.kernel
    try:
        best = result_of(kernel)
    except (KeyError, ValueError):  # a result file torch cannot read: the load ignores it too
        log.debug("autotuner of %s kept whole", autotuner.kernel_name, exc_info=True)
        return None
    if best is None:
        return None
    wanted = triton_config_to_hashable(best)
    result = next(
        (r for r in kernel.compile_results if triton_config_to_hashable(r.config) == wanted),
        built.get((kernel.filename, wanted)),
    )
    if result is None:
        return None
    kept = copy.copy(kernel)
    kept.compile_results = [result]
    kept.prepare_for_caching()  # a result built here still carries its binary
    return StaticallyLaunchedAutotuner(autotuner.cache_key, autotuner.kernel_name, kept)


@contextlib.contextmanager
def only_launched(result_of: ResultOf | None = None) -> Iterator[None]:
    """While entered, a compiled graph is given only the Triton kernels it launches, and with
    `result_of`, of a kernel tuned here only the config its autotune result names."""
    original = CompiledFxGraph.set_triton_bundle
    precompile = CachingAutotuner._precompile_config
    built: dict[tuple[str, Hashable], object] = {}

    def set_triton_bundle(self, triton_bundle):
        if isinstance(triton_bundle, TritonBundle):
            try:
                triton_bundle = selected(triton_bundle, self.source_code, result_of, built)
            except (AttributeError, TypeError):  # a torch whose bundle is shaped otherwise
                log.warning("Triton bundle kept whole: cannot select from it", exc_info=True)
        return original(self, triton_bundle)

    def precompile_config(self, cfg, *args, **kwargs):
        result = precompile(self, cfg, *args, **kwargs)
        if isinstance(result, StaticTritonCompileResult) and self.filename:
            try:  # as built, before a launcher loads it (what a bundled autotuner holds)
                built[(self.filename, triton_config_to_hashable(cfg))] = copy.deepcopy(result)
            except (TypeError, copy.Error):  # not copyable here: its kernel is kept whole
                log.debug("compile result of %s not kept", self.filename, exc_info=True)
        return result

    setattr(CompiledFxGraph, "set_triton_bundle", set_triton_bundle)  # noqa: B010
    setattr(CachingAutotuner, "_precompile_config", precompile_config)  # noqa: B010
    try:
        yield
    finally:
        setattr(CompiledFxGraph, "set_triton_bundle", original)  # noqa: B010
        setattr(CachingAutotuner, "_precompile_config", precompile)  # noqa: B010
