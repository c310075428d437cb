"""How long a load spends on the Triton kernels an artifact carries ready-built.

The worker's compile bundles the Triton kernels its output code launches (`TritonBundler`, on
by default outside fbcode: `bundle_triton_into_fx_graph_cache`; the selection:
torch_adapter/compile/triton_selection.py) into the compiled graph: the binaries (cubin and
its JSON metadata) and, with `use_static_cuda_launcher` (on by default), the statically
launchable autotuners. On load, `TritonBundler.read_and_emit` writes the binaries into
Triton's cache dir (the static launcher loads a cubin from a path) and files the static
autotuners where the output code's `async_compile.triton(...)` finds them, so a hit runs
neither Triton's compiler nor ptxas. `timed` adds the time of those calls to
`timings["load_triton_s"]`.

Uses torch._inductor.triton_bundler.TritonBundler.read_and_emit (a staticmethod called
through the class by FxGraphCache.cache_hit_post_compile, which the bundled AOTAutograd
entry's post-compile calls). Verified: torch 2.11.0, 2.13.0, 2.15.0 (sources; CPU runs).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from torch._inductor.triton_bundler import TritonBundler


@contextlib.contextmanager
def timed(timings: dict[str, float]) -> Iterator[None]:
    """Add the time spent emitting Triton bundles in the block to `timings`."""
    saved = TritonBundler.__dict__["read_and_emit"]
    original = saved.__func__

    def read_and_emit(bundle):
        started = time.perf_counter()
        try:
            return original(bundle)
        finally:
            timings["load_triton_s"] = (
                timings.get("load_triton_s", 0.0) + time.perf_counter() - started
            )

    setattr(TritonBundler, "read_and_emit", staticmethod(read_and_emit))  # noqa: B010
    try:
        yield
    finally:
        setattr(TritonBundler, "read_and_emit", saved)  # noqa: B010
