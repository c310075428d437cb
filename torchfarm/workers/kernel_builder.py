"""The pool's kernel builds: how a C++ object enters the cache that every tenant's compiles on
a pool read (workers/kernel_cache.py; docs/reliability.md, "Kernel reuse").

A compile child runs a tenant's code, so the objects it reports could be anything under any
name. What a shared job's child reports for the pool is therefore only sources: one
`KernelSource` per C++ library (Inductor's load_async arguments). After the job has ended,
the worker builds each source it has not built before, one at a time and at niceness 10
(compiles go first), in a builder child of its own: the compile sandbox (no network, no
secrets, a fresh private tmpfs, nothing staged), given that one source and nothing else.
The builder calls Inductor's own load_async for it, which names the objects after the source
and the pool's compile command and runs g++ on them; it never loads them, and reports what
it built. So the object
under a name is what the pool's compiler makes of the one source that name hashes; a hostile
payload can at most make the pool build, correctly, kernels whose sources it names.

`python -m torchfarm.workers.kernel_builder` is the builder child: a `KernelSource` on stdin,
a `KernelFiles` on stdout.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import WorkerSettings
from torchfarm.workers import kernel_cache, sandbox

log = logging.getLogger("torchfarm.worker")

BUILD_TIMEOUT_S = 600  # one library: seconds of g++ here, minutes on a crowded host
MAX_QUEUED = 1024  # sources waiting for a build; more are dropped (a later compile offers them)
_TRISTATE = {0: None, 1: False, 2: True}  # KernelSource.needs_vec_isa


def build(source: pb.KernelSource, cache_dir: str) -> pb.KernelFiles:
    """Builder child: build `source`'s objects into the empty `cache_dir` as a compile would
    (same class, command and precompiled header), without loading them; report them."""
    from torch._inductor import codecache

    from torchfarm.compiler.inductor import WORKER_CONFIG
    from torchfarm.torch_adapter import standalone

    if source.code_cache not in kernel_cache.CODE_CACHES:
        raise ValueError(f"not a C++ code cache: {source.code_cache!r}")
    code_cache = getattr(codecache, source.code_cache)
    builds: list = []  # run after load_async, which holds the lock that a build takes
    with standalone.inductor_config.patch(WORKER_CONFIG), standalone.cache_dir_at(cache_dir):
        code_cache.load_async(  # returns the loader, never called: nothing built is run
            source.main_code,
            "cpu",
            submit_fn=builds.append,
            optimized_code=source.optimized_code if source.has_optimized else None,
            needs_vec_isa=_TRISTATE[source.needs_vec_isa],
            kernel_needs_vec_isa=_TRISTATE[source.kernel_needs_vec_isa],
        )
        for build_now in builds:
            build_now()
    return kernel_cache.report(cache_dir, "")


class PoolBuilds:
    """The worker's queue of kernel builds for its pools, drained by one background thread."""

    def __init__(self, kernels: kernel_cache.KernelCache, settings: WorkerSettings) -> None:
        self.kernels, self.settings = kernels, settings
        self.waiting: queue.Queue[tuple[str, pb.KernelSource]] = queue.Queue(MAX_QUEUED)
        threading.Thread(target=self._drain, name="kernel-builds", daemon=True).start()

    def offer(self, pool_dir: str, sources: list[pb.KernelSource]) -> int:
        """Queue the sources not built for `pool_dir` yet; how many were queued."""
        queued = 0
        for source in sources:
            if self.kernels.built_before(pool_dir, source):
                continue
            try:
                self.waiting.put_nowait((pool_dir, source))
            except queue.Full:
                break
            queued += 1
        return queued

    def _drain(self) -> None:
        while True:
            pool_dir, source = self.waiting.get()
            if self.kernels.built_before(pool_dir, source):  # queued twice
                log.info("pool kernel build skipped: built already")
                continue
            started = time.perf_counter()
            try:
                files = self.run(source)
                self.kernels.keep(pool_dir, files)
                self.kernels.mark_built(pool_dir, source, sorted(files.built))
            except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as e:
                log.warning("pool kernel build failed: %s", str(e)[-500:])
                continue
            log.info(
                "pool kernel build: %d objects in %.1f s (%d waiting)",
                len(files.built),
                time.perf_counter() - started,
                self.waiting.qsize(),
            )

    def run(self, source: pb.KernelSource) -> pb.KernelFiles:
        """Build one source in a sandboxed builder child, at the lowest priority."""
        private_dir = tempfile.mkdtemp(prefix="torchfarm-kernel-build-")
        try:
            argv, env, cwd = sandbox.child_command(
                self.settings, private_dir, ("-m", "torchfarm.workers.kernel_builder")
            )
            limits = sandbox.limits(self.settings)

            def lowest_priority() -> None:
                limits()
                os.nice(10)

            proc = subprocess.run(
                argv,
                input=source.SerializeToString(),
                env=env,
                cwd=cwd,
                capture_output=True,
                timeout=BUILD_TIMEOUT_S,
                preexec_fn=lowest_priority,
                check=False,
            )
        finally:
            shutil.rmtree(private_dir, ignore_errors=True)
        if proc.returncode:
            raise RuntimeError(f"builder exit {proc.returncode}: {proc.stderr[-500:]!r}")
        return pb.KernelFiles.FromString(proc.stdout)  # protobuf parse: no code runs


def main() -> int:
    report = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever the build prints goes to stderr, never into the report
    source = pb.KernelSource.FromString(sys.stdin.buffer.read())
    files = build(source, os.environ["TORCHINDUCTOR_CACHE_DIR"])
    report.write(files.SerializeToString())
    report.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
