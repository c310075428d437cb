"""Inductor's pool of compile worker processes, started and answering before a compile.

Local torch.compile starts this pool as its Inductor backend is entered
(`torch/_dynamo/backends/inductor.py` calls `maybe_warm_pool`), so the pool's workers start
while Dynamo and AOTAutograd trace. A farm compile child enters Inductor through
standalone_compile, which never calls it: the pool was first created at the graph's first
Triton kernel, and until its workers answered, Inductor compiled kernels one after another in
the child's own process. A warm child therefore starts the pool and waits until it answers
before it reports ready, off the request's path. Inductor's subprocess pool serves Triton
kernels only (C++ kernels compile on threads), so `maybe_warm_pool` does nothing without
Triton: CPU-only builds are unaffected.

Uses `torch._inductor.async_compile.maybe_warm_pool` and `AsyncCompile.wait_pool_ready`.
Verified (source read): torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

import importlib.util
import sys

POOL_READY_TIMEOUT_S = 120


def start_and_wait(timeout_s: float = POOL_READY_TIMEOUT_S) -> None:
    """Start Inductor's compile worker pool and wait until it answers. A pool that cannot
    start is reported on stderr and left to Inductor, which then compiles in-process."""
    from torch._inductor.async_compile import AsyncCompile, maybe_warm_pool

    if not _has_triton():  # wait_pool_ready would start a pool all the same
        return
    try:
        maybe_warm_pool()
        AsyncCompile.wait_pool_ready(timeout_s)
    except Exception as e:  # a slower compile, never a failed one
        print(f"torchfarm: Inductor's compile workers not ready: {e}", file=sys.stderr)


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None
