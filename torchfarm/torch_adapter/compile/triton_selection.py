"""Bundle with each compiled graph only the Triton kernels its output code launches, and of
each only the files a load reads.

A max-autotune compile builds far more Triton kernels than its output code launches (every
GEMM template candidate it benchmarked, fusions it tried and dropped), and Triton keeps each
kernel's every build stage beside its binary. Inductor's bundle (`TritonBundler.collect`,
attached to the compiled graph by `CompiledFxGraph.set_triton_bundle`) packs them all: an
LLM's entry was 370 MB, 21x its default-mode entry (issue 52). While `only_launched()` is
entered, the bundle a graph gets is `selected` against its output code. Each rule keeps a
superset of what a load reads (where unsure, a file is kept):
- a kernel's cache entry is kept where the output code names its kernel as a whole word (all
  configs of one kernel share its name; a benchmarked template candidate has a name of its
  own, e.g. `triton_mm`, that the output code never mentions), or where a kept statically
  launchable autotuner loads its binary (torch skips an autotuner whose cubin is missing,
  and the kernel would then compile on the client);
- a statically launchable autotuner is kept where the output code names its kernel;
- of a kept entry's files only Triton's intermediate stages (INTERMEDIATES) are dropped, and
  its group file (`__grp__<name>.json`, Triton's index of the entry) then lists only the
  files kept. A load reads the metadata (`<name>.json`) and the binary: a cache hit in
  `triton.compile` builds its CompiledKernel from the group's files, using the binary and the
  JSON (3.6: `CompiledKernel.__init__`), the static launcher loads the cubin by path, and
  Triton's own `TRITON_STORE_BINARY_ONLY` keeps just these.
torch 2.13+ already leaves out the losing configs of a kernel it autotuned
(`TritonBundler.put_winner`); 2.11 bundles them all, and this keeps them (same name).

Uses torch._inductor.output_code.CompiledFxGraph.set_triton_bundle (and source_code), the
dataclasses TritonBundle / TritonKernelArtifacts / TritonKernelArtifact /
StaticallyLaunchedAutotuner of torch._inductor.triton_bundler, an autotuner's
compile_results[].kernel.hash and runtime_utils.triton_hash_to_path_key (how
`reload_cubin_path` finds the cubin). Verified on CPU by the unit tests, on synthetic cache
entries bundled and emitted by torch itself: torch 2.11.0 with triton 3.6.0 and 2.15.0 with
triton 3.9.0 (their cache managers find what is kept), 2.13.0. No real Triton kernel ran.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping

from torch._inductor.output_code import CompiledFxGraph
from torch._inductor.runtime.runtime_utils import triton_hash_to_path_key
from torch._inductor.triton_bundler import (
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


def selected(bundle: TritonBundle, output_code: str) -> TritonBundle:
    """`bundle` with only what a load of `output_code` reads."""
    autotuners = [a for a in bundle.static_autotuners if launched(a.kernel_name, output_code)]
    their_binaries = {
        triton_hash_to_path_key(result.kernel.hash)
        for autotuner in autotuners
        for result in autotuner.kernel.compile_results
    }
    kernels = []
    for entry in bundle.kernel_artifacts:
        files = {a.filename: a.payload for a in entry.artifacts}
        name = kernel_name(list(files))
        if entry.kernel_hash in their_binaries or (
            name is not None and launched(name, output_code)
        ):
            needed = needed_files(files)
            artifacts = [TritonKernelArtifact(n, data) for n, data in needed.items()]
            kernels.append(TritonKernelArtifacts(entry.kernel_hash, entry.device, artifacts))
    return TritonBundle(kernels, autotuners)


@contextlib.contextmanager
def only_launched() -> Iterator[None]:
    """While entered, a compiled graph is given only the Triton kernels it launches."""
    original = CompiledFxGraph.set_triton_bundle

    def set_triton_bundle(self, triton_bundle):
        if isinstance(triton_bundle, TritonBundle):
            try:
                triton_bundle = selected(triton_bundle, self.source_code)
            except (AttributeError, TypeError):  # a torch whose bundle is shaped otherwise
                log.warning("Triton bundle kept whole: cannot select from it", exc_info=True)
        return original(self, triton_bundle)

    setattr(CompiledFxGraph, "set_triton_bundle", set_triton_bundle)  # noqa: B010
    try:
        yield
    finally:
        setattr(CompiledFxGraph, "set_triton_bundle", original)  # noqa: B010
