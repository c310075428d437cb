"""One compile job on this worker, as named steps: preflight (is it still to be compiled
here?) -> stage kernels (what its child may reuse) -> child (the sandboxed compile) -> entry
(the index entry, keyed and signed here) -> store (artifact and entry, then the job's
outcome, which wakes its waiters) -> after (what nobody waits for: the pool's kernel builds,
eviction).

A step that ends the job early writes its outcome and raises _Stop; every way a run ends is
one `Result`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from typing import Any

from torchfarm.cache.store import Store
from torchfarm.compiler import compilers
from torchfarm.contract.cache_key import STRUCTURE
from torchfarm.contract.options import compiler_of
from torchfarm.errors import CacheFull, TorchfarmError
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import WorkerSettings
from torchfarm.workers import entry, run_kernels, sandbox

log = logging.getLogger("torchfarm.worker")


class Result(enum.Enum):
    """How a compile task ended; its value is the task's Celery result and metrics label."""

    COMPILED = "compiled"  # stored in the cache
    UNCACHED = "uncached"  # the cache was full: served from the job board
    FAILED = "failed"  # the compile failed (or this pool has no such compiler)
    CACHED = "cached"  # a redelivered task whose first run ended
    ABANDONED = "abandoned"  # every client that wanted it has gone
    EXPIRED = "expired"  # its payload expired before a worker took it
    DUPLICATE = "duplicate"  # a redelivered copy of a task whose first run is alive
    ERROR = "error"  # the worker could not run it


@dataclasses.dataclass(frozen=True)
class Ended:
    result: Result
    stored_bytes: int = 0


# A miss's timings the child gives (Artifact.backward_timings, its helper's backward): the
# MissTimings fields named so; every other field is the worker's.
CHILDS_TIMINGS = tuple(
    f.name for f in pb.MissTimings.DESCRIPTOR.fields if f.name.startswith(("backward_", "helper_"))
)


def miss_timings(
    artifact: pb.Artifact, queued_s: float, handoff_s: float, child_s: float
) -> pb.MissTimings:
    """A miss's timings as the worker answers them (store_s set once stored): its own, and of
    the child's only CHILDS_TIMINGS, where the helper compiled its backward, so that a child
    neither speaks for the worker's clock nor sends anything else through (unknown fields)."""
    timings = pb.MissTimings(
        queued_s=queued_s, handoff_s=handoff_s, child_s=child_s, compile_s=artifact.compile_seconds
    )
    if artifact.backward == "helper":
        for name in CHILDS_TIMINGS:
            setattr(timings, name, getattr(artifact.backward_timings, name))
    return timings


def _helped(timings: pb.MissTimings) -> str:
    """A helped backward's timings, for the worker's "stored" line ("-": a part the helper
    did not reach, or left no time for: unset)."""

    def at(field: str) -> str:
        seconds = getattr(timings, field)
        return f"{seconds:.1f} s" if seconds else "-"

    return (
        f" (the child at its key {timings.backward_at_s:.1f} s in, waited "
        f"{timings.backward_wait_s:.2f} s, loaded it in {timings.backward_load_s:.2f} s; "
        f"the helper began it at {at('helper_began_s')}, lowered it at "
        f"{at('helper_lowered_s')}, compiled it at {at('helper_compiled_s')})"
    )


class _Stop(TorchfarmError):
    """A step ended the job (its outcome written): the run stops with `result`."""

    def __init__(self, result: Result) -> None:
        super().__init__(result)
        self.result = result


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """What the child made, as the store step keeps it."""

    data: bytes
    meta: pb.EntryMeta
    timings: pb.MissTimings
    read_back: float  # time.perf_counter() once the child's bytes were in hand
    backward: str  # who compiled the backward, where a helper did (Artifact.backward)
    backward_miss: str  # why the child's lookup of the helper's backward missed, if it did


@dataclasses.dataclass
class CompileRun:
    """The run of one job this worker holds the lease of."""

    job: pb.Job
    settings: WorkerSettings
    store: Store
    pool: str  # the queue it came from
    taken: float = dataclasses.field(default_factory=time.time)

    def run(self) -> Ended:
        try:
            payload = self.preflight()
            staged = run_kernels.stage(self.settings, self.store, self.pool, self.job, self.extra)
            handed = time.perf_counter()
            child = self.child(payload, staged)
            compiled = self.entry(payload, child, handed)
            self.keep(compiled, staged, child)
        except _Stop as stop:
            return Ended(stop.result)
        self.after(staged, child.kernels)
        return Ended(Result.COMPILED, len(compiled.data))

    @property
    def extra(self) -> dict[str, str]:
        return log_fields(self.job)

    def preflight(self) -> bytes:
        """The job's payload, where it is still to be compiled, by this pool."""
        job, jobs = self.job, self.store.jobs
        if jobs.outcome(job.job_id) is not None:  # a redelivered task whose first run ended
            raise _Stop(Result.CACHED)
        if jobs.abandoned(job.job_id):
            self.store.counters.count(self.pool, abandoned=1)
            self._finish(
                pb.JobOutcome(kind=pb.JobOutcome.ABANDONED, error="no client waits for it any more")
            )
            log.info("skipped %s: no client waits for it any more", job.key[:16], extra=self.extra)
            raise _Stop(Result.ABANDONED)
        payload = jobs.payload(job.job_id)
        if payload is None:
            self._finish(
                pb.JobOutcome(
                    kind=pb.JobOutcome.WORKER_ERROR,
                    error="the job's payload expired before a worker took it",
                )
            )
            raise _Stop(Result.EXPIRED)
        compiler = compiler_of(job.options)
        if compiler not in compilers.parse(self.settings.compilers):  # no child for it
            self._finish(
                pb.JobOutcome(
                    kind=pb.JobOutcome.FAILED,
                    error=f"pool {self.pool} does not run the compiler {compiler!r} "
                    f"(its TORCHFARM_COMPILERS: {self.settings.compilers})",
                )
            )
            raise _Stop(Result.FAILED)
        jobs.set_stage(job.job_id, pb.Progress.COMPILING)
        log.info(
            "compiling %s (%s) for tenant %s", job.key[:16], job.label, job.tenant, extra=self.extra
        )
        return payload

    def child(self, payload: bytes, staged: run_kernels.Staged | None) -> sandbox.ChildResult:
        """Compile in a sandboxed child; a failed compile ends the job."""
        job, jobs = self.job, self.store.jobs
        spec = sandbox.ChildSpec(
            payload,
            job.target,
            job.options,
            dict(job.size_hints),
            dict(job.float_hints),
            descriptor=job.descriptor,
            on_stage=lambda stage: jobs.set_stage(job.job_id, stage),
            abandoned=lambda: jobs.abandoned(job.job_id),
            kernels_from=staged.dirs if staged else (),
            report_built=bool(staged and staged.tenant_dir),
            report_sources=staged is not None and not job.private,
            pool_build=run_kernels.pool_build(staged, self.settings, job),
        )
        try:
            return sandbox.run_compile(spec, self.settings)
        except sandbox.CompileFailed as e:
            raise _Stop(self._failed(e)) from e

    def _failed(self, e: sandbox.CompileFailed) -> Result:
        """End the job with how its compile failed, remembering a lasting failure."""
        key = self.job.key[:16]
        if e.kind == pb.JobOutcome.ABANDONED:  # its clients left: the slot is free again
            log.info("stopped %s: no client waits for it any more", key, extra=self.extra)
            self.store.counters.count(self.pool, abandoned=1)
            self._finish(e.outcome())
            return Result.ABANDONED
        log.warning("compile of %s failed: %s", key, str(e)[-3000:], extra=self.extra)
        self.store.counters.count(self.pool, compile_failures=1)
        self._finish(e.outcome(), remember_s=self.settings.failure_memory_s if e.lasting else 0)
        return Result.FAILED

    def entry(self, payload: bytes, child: sandbox.ChildResult, handed: float) -> _Compiled:
        """The artifact's index entry, signed, and the worker's account of the miss."""
        read_back = time.perf_counter()
        artifact = pb.Artifact.FromString(child.data)
        self.store.counters.count(
            self.pool,
            compiles=1,
            compile_seconds=artifact.compile_seconds,
            gemm_candidates_benchmarked=child.kernels.gemm_candidates_benchmarked,
        )
        meta = entry.entry_meta(self.job, payload, child.data, artifact, self.pool)
        if self.settings.signing_key:  # else TORCHFARM_INSECURE_UNSIGNED (run_worker warned)
            entry.sign(meta, self.settings.signing_key)
        timings = miss_timings(
            artifact,
            queued_s=max(0.0, self.taken - self.job.queued_at) if self.job.queued_at else 0.0,
            handoff_s=child.handoff_s,
            child_s=read_back - handed - child.handoff_s,
        )
        return _Compiled(
            child.data, meta, timings, read_back, artifact.backward, artifact.backward_miss
        )

    def keep(
        self, compiled: _Compiled, staged: run_kernels.Staged | None, child: sandbox.ChildResult
    ) -> None:
        """Store artifact and entry (or, the cache full, hand the artifact to the waiters
        through the job board) and the kernels the child built; then end the job."""
        job, meta, timings = self.job, compiled.meta, compiled.timings
        try:
            stored = self.store.artifacts.put(job.key, compiled.data, meta)
        except CacheFull:
            log.warning(
                "the cache's storage is full: %s served uncached", job.key[:16], extra=self.extra
            )
            timings.store_s = time.perf_counter() - compiled.read_back
            log.info(
                "answered (cache full) %s: %d bytes",
                job.key[:16],
                len(compiled.data),
                extra=self.extra,
            )
            self._finish(
                pb.JobOutcome(kind=pb.JobOutcome.UNCACHED, digest=meta.digest, timings=timings),
                uncached=(meta, compiled.data),
            )
            raise _Stop(Result.UNCACHED) from None
        if STRUCTURE in meta.key_parts:
            self.store.structures.add(job.tenant, meta.key_parts[STRUCTURE], job.key)
        timings.store_s = time.perf_counter() - compiled.read_back
        if staged:
            run_kernels.keep(staged, self.store, child.kernels, child.pool_built, self.extra)
        # Logged before the job ends: its waiters wake at once (a log read then finds the line).
        log.info(
            "stored %s: %d bytes, %.1f s compiling, %.2f s hand-off to a child%s%s%s",
            job.key[:16],
            len(compiled.data),
            timings.compile_s,
            timings.handoff_s,
            f", backward compiled by the {compiled.backward}" if compiled.backward else "",
            _helped(timings) if compiled.backward == "helper" else "",
            f" (its lookup missed: {compiled.backward_miss})" if compiled.backward_miss else "",
            extra=dict(self.extra, pool=self.pool),
        )
        self._finish(
            pb.JobOutcome(kind=pb.JobOutcome.STORED, digest=stored.digest, timings=timings)
        )

    def after(self, staged: run_kernels.Staged | None, kernels: pb.KernelFiles) -> None:
        """What nobody waits for: the pool's kernel builds, and the cache's budget."""
        if staged:
            run_kernels.offer_builds(staged, self.store, self.settings, kernels, self.extra)
        evicted = self.store.artifacts.evict(
            self.settings.cache_max_bytes, self.settings.cache_ttl_s
        )
        if evicted:
            log.info("evicted %d keys to fit the cache budget", len(evicted))

    def _finish(self, outcome: pb.JobOutcome, **finish: Any) -> None:
        """End the job with its one outcome, which wakes its waiters (JobBoard.finish)."""
        self.store.jobs.finish(self.job.job_id, outcome, **finish)


def log_fields(job: pb.Job) -> dict[str, str]:
    """The `extra` of a log line about a job (logs.FIELDS): the job id the gateway logged and
    the client heard, and the request that queued it."""
    return {
        "request_id": job.request_id,
        "job_id": job.job_id,
        "tenant": job.tenant,
        "key": job.key,
    }
