"""The kernel cache's part in one compile (workers/kernel_cache.py): the directories staged
for its child, the C++ libraries a shared job's child asks the pool to build during its compile
(kernel_builder.CompileBuilds), what the child built kept for its tenant, and the sources it
recorded queued for the pool's builds once the job has ended (workers/kernel_builder.py)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable

import redis

from torchfarm.cache.store import Store
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import WorkerSettings, sizing
from torchfarm.workers import kernel_builder, kernel_cache, toolchain

log = logging.getLogger("torchfarm.worker")


@dataclasses.dataclass(frozen=True)
class Staged:
    """A compile's kernel directories: the pool's (for every job) and, for a private job, its
    tenant's own (the tenant chooses what it holds); the pool's kernel generation then."""

    cache: kernel_cache.KernelCache
    pool: str
    pool_dir: str
    tenant_dir: str  # "" for a shared job
    generation: int

    @property
    def dirs(self) -> tuple[str, ...]:
        return tuple(d for d in (self.pool_dir, self.tenant_dir) if d)


@functools.cache
def kernel_cache_of(settings: WorkerSettings) -> kernel_cache.KernelCache | None:
    """This worker's kernel cache, or None where TORCHFARM_KERNEL_CACHE_MB is 0."""
    if not settings.kernel_cache_mb:
        return None
    root = settings.kernel_cache_dir or os.path.join(
        os.path.expanduser("~"), ".cache", "torchfarm", "kernels"
    )
    return kernel_cache.KernelCache(root, toolchain.toolchain_id(), settings.kernel_cache_mb << 20)


def stage(
    settings: WorkerSettings, store: Store, pool: str, job: pb.Job, extra: dict
) -> Staged | None:
    """The directories a compile of `job` reads its kernels from, emptied first where the
    pool's kernels were dropped since this worker last looked; None with the cache off."""
    cache = kernel_cache_of(settings)
    if cache is None:
        return None
    generation = store.pools.kernel_generation(pool)
    if cache.renew(pool, generation):
        log.info("kernel cache: dropped (generation %d)", generation, extra=extra)
    tenant_dir = cache.tenant_dir(pool, job.tenant) if job.private else ""
    return Staged(cache, pool, cache.pool_dir(pool), tenant_dir, generation)


# settings -> the builders its compiles hand their C++ builds to, once started
_compile_builds: dict[WorkerSettings, kernel_builder.CompileBuilds] = {}


def start_compile_builds(settings: WorkerSettings) -> None:
    """Start the builders a CPU pool's shared compiles hand their C++ builds to (with the
    kernel cache on): once the worker's toolchain is settled, so that they build with the ISA
    verdict and precompiled headers the compile children have."""
    kernels = kernel_cache_of(settings)
    if kernels is None or settings.device != "cpu":
        return
    size = sizing.compile_kernel_builds()
    _compile_builds[settings] = kernel_builder.CompileBuilds(kernels, settings, size)
    log.info("kernel builders for compiles started: %d", size)


def pool_build(
    staged: Staged | None, settings: WorkerSettings, job: pb.Job
) -> Callable[[pb.KernelSource], tuple[str, list[str]]] | None:
    """What a shared job's child asks the pool to build goes to the pool's builders
    (sandbox.ChildSpec.pool_build); None for a private job, or before they are started (the
    child then builds its libraries itself, and they are offered after the job)."""
    builds = _compile_builds.get(settings)
    if staged is None or job.private or builds is None:
        return None

    def build(source: pb.KernelSource) -> tuple[str, list[str]]:
        return staged.pool_dir, builds.build(staged.pool_dir, source)

    return build


def keep(
    staged: Staged, store: Store, files: pb.KernelFiles, pool_built: tuple[str, ...], extra: dict
) -> None:
    """Before the job ends (its tenant's next compile finds them): keep what the compile built
    for its tenant, unless the pool's kernels were dropped meanwhile, and count its reuse (of
    objects it found staged, not those the pool built for it: `pool_built`)."""
    undropped = store.pools.kernel_generation(staged.pool) == staged.generation
    if undropped:
        _keep_files(staged, files, pool_built, extra)
    else:  # what it built may hold what was dropped (timings grown from staged ones)
        log.info("kernel cache: dropped during the compile, nothing kept", extra=extra)
    tuned = [n for n in files.built if n.startswith(kernel_cache.TUNING + "/")]
    store.counters.count(
        staged.pool,
        kernels_reused=len(set(files.reused) - set(pool_built)),
        tuning_stored=len(tuned) if staged.tenant_dir and undropped else 0,
        tuning_reused=files.tuning_reused,
        tuning_seconds_saved=files.tuning_seconds_saved,
    )


def offer_builds(
    staged: Staged, store: Store, settings: WorkerSettings, files: pb.KernelFiles, extra: dict
) -> None:
    """After the job ended (no waiter waits for builds): queue the sources the compile
    recorded, and the pool's tuning builds new to this worker, for the pool's builds."""
    builds = kernel_builder.builds_of(files) + _pool_tuning(store, staged.pool, staged.generation)
    if builds:
        kept = functools.partial(_tuning_kept, store, staged.pool)
        queued = _pool_builds(settings).offer(staged.pool_dir, builds, kept)
        log.info("kernel cache: %d sources queued for the pool's builds", queued, extra=extra)


@functools.cache
def _pool_builds(settings: WorkerSettings) -> kernel_builder.PoolBuilds:
    kernels = kernel_cache_of(settings)
    assert kernels is not None
    return kernel_builder.PoolBuilds(kernels, settings)


def _tuning_kept(store: Store, pool: str, source: pb.KernelBuild, stored: int) -> None:
    """A pool build's tuning results, counted as its compiles' are (`torchfarm cache stats`);
    its source remembered for the pool's other workers and for bundles."""
    if not stored:
        return
    try:  # on the builds' thread: a Redis failure costs the counters, never later builds
        store.counters.count(pool, tuning_stored=stored)
        store.pools.add_tuning(pool, [source])
    except redis.RedisError as e:
        log.warning("pool tuning not recorded: %s", e)


# pool -> (kernel generation, number of tuning builds) when this worker last read them
_tuning_seen: dict[str, tuple[int, int]] = {}


def _pool_tuning(store: Store, pool: str, generation: int) -> list[pb.KernelBuild]:
    """The pool's tuning builds (other workers', a bundle's) whenever they changed since this
    worker last read them (builds are only added, until a drop raises the generation): each
    one it has not built is queued for its own builder, which checks it as any source."""
    seen = (generation, store.pools.tuning_count(pool))
    if _tuning_seen.get(pool) == seen:
        return []
    _tuning_seen[pool] = seen
    return store.pools.tuning(pool)


def _keep_files(
    staged: Staged, files: pb.KernelFiles, pool_built: tuple[str, ...], extra: dict
) -> None:
    """Keep what a private compile built for its tenant, and mark the objects a compile
    reused as used now; a failure costs later compiles only."""
    try:
        staged.cache.touch(staged.pool_dir, files.reused)
        stored = staged.cache.keep(staged.tenant_dir, files)[0] if staged.tenant_dir else 0
    except OSError:
        log.exception("could not keep the compile's kernels", extra=extra)
        return
    log.info(
        "kernel cache: %d objects reused, %d kept, %d tuning results reused (%.1f s of "
        "tuning), %d GEMM candidates benchmarked, %d objects built by the pool for it",
        len(set(files.reused) - set(pool_built)),
        stored,
        files.tuning_reused,
        files.tuning_seconds_saved,
        files.gemm_candidates_benchmarked,
        len(pool_built),
        extra=extra,
    )
