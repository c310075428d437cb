"""What a fresh process's first artifact load needs, done before it is needed.

A hit's load is mostly one-time work of the process, not of the artifact: Inductor's hash
of torch's sources (`torch_key`, in its kernels' and tuning caches' keys) and, with Triton,
building Triton's driver stubs (a C compiler run) and hashing Triton. On an H100 (torch
2.11, bench/gpu `profile`) that was 4.3 s of a 4.8 s GPT hit (when this imported Inductor's
compile path).
torch.compile(backend="inductor") pays the imports inside torch.compile and the rest along its
first step, one after another.

`torch_key` is not hashed here: every artifact carries its worker's (Artifact.torch_key, the
same torch build), and the load takes it (`known_torch_key`). Hashed on this thread it took
0.3-0.4 s alone and, beside Dynamo's trace, 4.2 s of GIL-shared time, after which the first
load still waited 1.1 s for it (H200, llama, 2026-11-29).

Nothing of Inductor is imported here: a load imports no more than the client's own modules
do. Not Inductor's compile path (compile_fx, its lowerings and kernel templates), which
neither the worker's output code (torch_adapter/compile/light_wrapper.py) nor the load
(graph_import.py) imports; imported here, it was 28% of a CPU skip hit (docs/benchmarks.md).
Nor Inductor's decompositions, which an artifact names no more (decompositions.py), nor its
debug module (debug_flags.py): imported here, they took 0.25 s on the CPU box (torch 2.13,
the collector off), a fifth of a skip hit's imports. A graph that the farm cannot serve
imports them where it compiles locally, and an older worker's artifact as it loads.

Triton's driver build (a C compiler run, then `ptxas --version`) waits on subprocesses, not
the GIL, so it runs on a thread of its own, started first, beside Triton's hashing.

`start` runs when the farm's backend is chosen (client/entry.py, inside torch.compile, as
Inductor's imports are; torchfarm.compile): it imports Triton's modules on the calling
thread — imports on two threads at once can meet a half-initialised module of torch's
circular imports — and leaves the hashing and the compiler run to a thread, where they
overlap Dynamo's tracing and the client's imports (started after Inductor's compile path was
imported, 1-2 s, the first load of a skip hit waited 0.8 s for the thread: H200, qwen3,
2026-11-29). A load `wait`s for that thread: it never races it. In no-wait mode the first
step runs eagerly and loads nothing, and that thread, which takes the GIL between files,
slowed Dynamo's tracing of it (issue 27, finding 7): there `start(defer=True)` imports only,
and the thread starts at `resume` (after the first step) or in the first load's `wait`.

Uses `torch._inductor.codecache.torch_key` and
`torch.utils._triton.triton_backend` / `triton_hash_with_backend` and
`torch._inductor.runtime.triton_compat.triton_key`. Verified (source read): torch 2.11.0,
2.13.0, 2.15.0.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("torchfarm.client")
_lock = threading.Lock()
_thread: threading.Thread | None = None
_deferred: list[Callable[[], object]] | None = None  # imported, its thread not started yet


def start(defer: bool = False) -> None:
    """Import Triton's modules, then hash and build on a thread (with `defer`: from `resume`
    on); once per process."""
    global _deferred
    with _lock:
        if _thread is None and _deferred is None:
            _deferred = _triton_work()
    if not defer:
        resume()


def resume() -> None:
    """Start the hashing and building thread of a deferred `start` (at most once)."""
    global _thread, _deferred
    with _lock:
        if _deferred is not None:
            _thread = threading.Thread(
                target=_run, args=(_deferred,), name="torchfarm-prewarm", daemon=True
            )
            _deferred = None
            _thread.start()


def wait() -> None:
    """Block until the work has finished (started here if it was deferred; at once if it
    never started)."""
    resume()
    if _thread is not None:
        _thread.join()


def known_torch_key(key: bytes) -> None:
    """Take the worker's torch_key (Artifact.torch_key: the same torch build) as this
    process's, unless it has one already or the artifact carries none (an older worker's:
    Inductor then hashes torch's sources when it first needs the key)."""
    if not key:
        return
    from torch._inductor.codecache import torch_key

    try:
        torch_key.set(key)  # type: ignore[attr-defined]
    except (AssertionError, RuntimeError):  # set already: 2.11 asserts, later releases raise
        pass


def _triton_work() -> list[Callable[[], object]]:
    """Import what the thread's work needs (Triton and torch's shims over it); that work."""
    try:
        import torch

        if importlib.util.find_spec("triton") is None or not torch.cuda.is_available():
            return []
        import triton.compiler.compiler  # noqa: F401
        import triton.runtime.driver  # noqa: F401
        from torch._inductor.runtime.triton_compat import triton_key
        from torch.utils._triton import triton_backend, triton_hash_with_backend

        driver = _beside(lambda: triton_backend().hash())
        return [driver.start, triton_key, driver.join, triton_hash_with_backend]
    except Exception as e:  # only ever a slower load: the load does the same work itself
        log.debug("prewarming the artifact load: %s", e)
        return []


def _beside(build: Callable[[], object]) -> threading.Thread:
    """A thread for work that waits on subprocesses, started and joined as steps of `_run`."""
    return threading.Thread(
        target=_run, args=([build],), name="torchfarm-prewarm-driver", daemon=True
    )


def _run(work: list[Callable[[], object]]) -> None:
    for step in work:
        started = time.perf_counter()
        try:
            step()
        except Exception as e:
            log.debug("prewarming the artifact load: %s", e)
        took = time.perf_counter() - started
        log.debug("prewarm %s: %.3f s", getattr(step, "__qualname__", step), took)
