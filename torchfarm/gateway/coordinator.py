"""The gateway's work, without gRPC: look entries up, serve a hit or single-flight a miss
(claim, post, enqueue), and wait for the outcome, as a stream of typed events.

It owns the typed Job it hands to workers. Transport concerns (authentication, request
validation, status codes, chunking) stay in gateway/server.py; the queue is injected
(`enqueue`), so the coordinator runs against a bare redis-server in unit tests.

Waiting is event-driven: a waiter subscribes to the job's notifications before it reads the
job's state, and wakes when the worker changes the stage or writes the outcome; a coarse
re-check (PROGRESS_EVERY_S) only sends progress ticks and notices a deadline or a vanished
claim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator

from torchfarm.cache.store import Store
from torchfarm.contract.cache_key import cache_key, job_id, private_key
from torchfarm.contract.pools import describe, pool_name
from torchfarm.gateway import metrics
from torchfarm.proto import torchfarm_pb2 as pb

log = logging.getLogger("torchfarm.gateway")
PROGRESS_EVERY_S = 1.0
Enqueue = Callable[[pb.Job, str], None]  # (job, pool): queue the job on the pool's queue


class Failure(enum.Enum):
    """Why a request ends without an artifact."""

    FAILED = "failed"  # the compile failed, now or recently (failure memory)
    TIMED_OUT = "timed out"  # the worker's or the gateway's deadline passed
    WORKER_ERROR = "worker error"  # the worker could not run the compile
    NO_POOL = "no pool"  # no worker serves the target
    TENANT_LIMIT = "tenant limit"  # the tenant already waits on its maximum of compiles


_OUTCOME_FAILURES = {
    pb.JobOutcome.FAILED: Failure.FAILED,
    pb.JobOutcome.TIMED_OUT: Failure.TIMED_OUT,
    pb.JobOutcome.WORKER_ERROR: Failure.WORKER_ERROR,
}


@dataclasses.dataclass(frozen=True)
class Progress:
    stage: pb.Progress.Stage.ValueType
    elapsed_s: float


@dataclasses.dataclass(frozen=True)
class Served:
    """The artifact: from the cache ("hit"), this request's compile ("miss"), or another
    request's compile it waited on ("merged")."""

    key: str
    entry: pb.EntryMeta
    data: bytes
    source: str


@dataclasses.dataclass(frozen=True)
class Failed:
    kind: Failure
    message: str


Event = Progress | Served | Failed


@dataclasses.dataclass(frozen=True)
class CompileCall:
    """A validated Compile request (options canonical) and who sent it."""

    request: pb.CompileRequest
    options: pb.Options
    tenant: str
    request_id: str


class Coordinator:
    def __init__(
        self,
        store: Store,
        enqueue: Enqueue,
        compile_timeout_s: float,
        tenant_max_compiles: int = 0,
    ):
        self.store = store
        self.enqueue = enqueue
        self.compile_timeout_s = compile_timeout_s
        self.tenant_max_compiles = tenant_max_compiles
        self._waiting: dict[str, int] = {}  # per tenant: requests waiting on a compile
        self._waiting_lock = threading.Lock()

    def lookup(self, key: str, private: bool, tenant: str) -> tuple[str, list[pb.EntryMeta]]:
        """The key the tenant meant (its own, derived, for a private lookup) and the entries
        under it that the tenant may see."""
        if private:
            key = private_key(key, tenant)
        visible = [
            e for e in self.store.artifacts.entries(key) if not e.private or e.tenant == tenant
        ]
        return key, visible

    def compile(self, call: CompileCall, is_active: Callable[[], bool]) -> Iterator[Event]:
        """Serve the request's artifact, compiling it if need be; ends with Served or Failed."""
        request, tenant = call.request, call.tenant
        started = time.monotonic()
        key = cache_key(
            request.graph, request.target, call.options, tenant if request.private else None
        )
        job = pb.Job(
            key=key,
            job_id=job_id(key, request.size_hints),
            target=request.target,
            options=call.options,
            size_hints=request.size_hints,
            tenant=tenant,
            private=request.private,
            label=request.label,
            request_id=call.request_id,
        )
        extra = {"request_id": call.request_id, "tenant": tenant, "key": key}

        hit = self._cached(key, request.digest)
        if hit is not None:
            entry, data = hit
            log.info("hit %s for %s: %s", key[:16], tenant, request.label, extra=extra)
            self.store.artifacts.record_hit(key, entry.digest)
            self.store.counters.count(
                entry.pool,
                hits=1,
                bytes_served=len(data),
                compile_seconds_saved=entry.compile_seconds,
            )
            metrics.RESULTS.labels("hit").inc()
            metrics.BYTES_SERVED.inc(len(data))
            yield Served(key, entry, data, "hit")
            return

        failure = self.store.jobs.failure(job.job_id)
        if failure is not None:
            metrics.RESULTS.labels("failed").inc()
            yield Failed(
                Failure.FAILED,
                f"compile failed on the farm: {failure}\n(a recent compile of this graph, not "
                "retried for the worker's TORCHFARM_FAILURE_MEMORY)",
            )
            return
        pool = pool_name(request.target)
        pools = self.store.pools.live()
        if pool not in pools:
            served = (
                "; ".join(
                    f"{name} ({info.get('describe', '')})" for name, info in sorted(pools.items())
                )
                or "none"
            )
            yield Failed(
                Failure.NO_POOL,
                f"no pool serves target {describe(request.target)} (pool {pool}). "
                f"Pools available: {served}",
            )
            return
        with self._compile_slot(tenant) as refused:
            if refused:
                yield Failed(Failure.TENANT_LIMIT, refused)
                return
            source = "miss" if self._claim_and_enqueue(job, request.graph, pool) else "merged"
            self.store.counters.count(pool, **{"misses" if source == "miss" else "merges": 1})
            metrics.RESULTS.labels(source).inc()
            log.info(
                "%s %s for %s: %s",
                source,
                key[:16],
                tenant,
                request.label,
                extra=dict(extra, pool=pool),
            )
            yield from self._wait(job, request.graph, pool, started, source, is_active)

    @contextlib.contextmanager
    def _compile_slot(self, tenant: str) -> Iterator[str]:
        """Hold one of the tenant's compile slots (TORCHFARM_TENANT_MAX_COMPILES, counted per
        gateway) while its request waits on a compile; yields why not if none is free."""
        limit = self.tenant_max_compiles
        with self._waiting_lock:
            waiting = self._waiting.get(tenant, 0)
            if limit and waiting >= limit:
                refused = (
                    f"tenant {tenant or '(open farm)'} already waits on {waiting} "
                    f"compiles (limit {limit}); retry when one finishes"
                )
            else:
                refused = ""
                self._waiting[tenant] = waiting + 1
        if refused:
            yield refused
            return
        try:
            yield ""
        finally:
            with self._waiting_lock:
                self._waiting[tenant] -= 1

    def _cached(self, key: str, digest: str) -> tuple[pb.EntryMeta, bytes] | None:
        """The entry the client chose (its guards hold there), or else an unguarded entry
        (it holds everywhere), verified; None means compile."""
        artifacts = self.store.artifacts
        entry = (
            artifacts.entry(key, digest)
            if digest
            else next((e for e in artifacts.entries(key) if not e.guards.all), None)
        )
        if entry is None:
            return None
        data = artifacts.read(key, entry)
        if data is None:
            log.warning("dropped corrupt or missing blob %s of %s", entry.digest[:16], key[:16])
            return None
        return entry, data

    def _claim_and_enqueue(self, job: pb.Job, payload: bytes, pool: str) -> bool:
        ttl = int(self.compile_timeout_s) + 60
        if not self.store.jobs.claim(job.job_id, ttl):
            return False
        self.store.jobs.post(job.job_id, payload)
        self.enqueue(job, pool)
        return True

    def _wait(
        self,
        job: pb.Job,
        payload: bytes,
        pool: str,
        started: float,
        source: str,
        is_active: Callable[[], bool],
    ) -> Iterator[Event]:
        deadline = started + self.compile_timeout_s
        next_progress = 0.0
        with self.store.jobs.watch(job.job_id) as watch:
            while is_active():
                state = self.store.jobs.state(job.job_id)
                ended = (
                    None if state.outcome is None else self._ended(job, state.outcome, pool, source)
                )
                if ended is not None:
                    yield ended
                    return
                now = time.monotonic()
                if now > deadline:
                    yield Failed(
                        Failure.TIMED_OUT,
                        f"compile did not finish in {self.compile_timeout_s:.0f} s",
                    )
                    return
                # The compiler vanished without an outcome, or its artifact is gone: take over.
                if not state.claimed:
                    self._claim_and_enqueue(job, payload, pool)
                if now >= next_progress:
                    yield Progress(state.stage, now - started)
                    next_progress = now + PROGRESS_EVERY_S
                watch.wait(max(0.0, min(next_progress, deadline) - time.monotonic()))

    def _ended(self, job: pb.Job, outcome: pb.JobOutcome, pool: str, source: str) -> Event | None:
        """The event that ends the wait; None if the stored artifact is already gone."""
        if outcome.kind in _OUTCOME_FAILURES:
            return Failed(
                _OUTCOME_FAILURES[outcome.kind], f"compile failed on the farm: {outcome.error}"
            )
        hit = (
            self._cached(job.key, outcome.digest)
            if outcome.kind == pb.JobOutcome.STORED
            else self.store.jobs.uncached(job.job_id, outcome.digest)
        )
        if hit is None:
            return None
        entry, data = hit
        saved = entry.compile_seconds if source == "merged" else 0.0
        self.store.counters.count(pool, bytes_served=len(data), compile_seconds_saved=saved)
        metrics.BYTES_SERVED.inc(len(data))
        if source == "miss":
            metrics.COMPILE_SECONDS.labels(pool, job.options.mode).observe(entry.compile_seconds)
        return Served(job.key, entry, data, source)
