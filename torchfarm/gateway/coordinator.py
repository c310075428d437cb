"""The gateway's work, without gRPC: look entries up, serve a hit or single-flight a miss
(claim, post, enqueue), and wait for the outcome, as a stream of typed events.

`get` answers Get's ask (a key the client computed, and its SymInt sizes) from the cache
alone: the newest entry the tenant may see whose shape guards hold on those sizes. It only
ever reads; a miss goes on through `compile`, which computes the key from the payload.

It owns the typed Job it hands to workers. Transport concerns (authentication, request
validation, status codes, chunking) stay in gateway/server.py; the queue is injected
(`enqueue`), so the coordinator runs against a bare redis-server in unit tests.

Waiting is event-driven: a waiter subscribes to the job's notifications before it reads the
job's state, and wakes when the worker changes the stage or writes the outcome; a new stage
is told to the client at once; a coarse re-check (PROGRESS_EVERY_S) only sends progress ticks
and notices a deadline or a vanished claim.

Nothing a fault leaves behind stalls anyone: a claim is released (and its waiters told) on
any failure after it was taken; each waiting request keeps its id in the job's waiter set
while it waits, so a job nobody waits for any more is skipped by the worker; and the
tenant's compile limit counts its queued and running jobs on the job board, across gateways,
not open RPCs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import time
import uuid
from collections.abc import Callable, Iterator

from torchfarm.cache.artifacts import Codec, OutOfMemoryError
from torchfarm.cache.store import Store
from torchfarm.contract import shape_guards
from torchfarm.contract.cache_key import cache_key, job_id, private_key
from torchfarm.contract.pools import describe, pool_name
from torchfarm.errors import TorchfarmError
from torchfarm.gateway import explain, metrics, prefetch
from torchfarm.gateway.hit_ledger import HitLedger
from torchfarm.gateway.recent_index import RecentIndex
from torchfarm.proto import torchfarm_pb2 as pb

log = logging.getLogger("torchfarm.gateway")
PROGRESS_EVERY_S = 1.0  # a waiting client hears from the gateway at least this often
WAITER_TTL_S = 10.0  # a waiter that stopped refreshing (its gateway hung or died) is gone
LIVENESS_EVERY_S = 5.0  # how often a waiter of a queued job asks whether its pool took it
# A queued job still untaken while a worker of its pool had a free slot this long was lost
# (its message went with a worker that died taking it): its waiter queues it again.
QUEUE_GRACE_S = 5.0
Enqueue = Callable[[pb.Job, str], None]  # (job, pool): queue the job on the pool's queue


class TooLarge(TorchfarmError):
    """The entry that holds does not fit where it was asked for (Coordinator.get)."""


class Failure(enum.Enum):
    """Why a request ends without an artifact."""

    FAILED = "failed"  # the compile failed, now or recently (failure memory)
    TIMED_OUT = "timed out"  # the worker's or the gateway's deadline passed
    WORKER_ERROR = "worker error"  # the worker could not run the compile
    NO_POOL = "no pool"  # no worker serves the target
    TENANT_LIMIT = "tenant limit"  # the tenant already has its maximum of compiles queued
    UNAVAILABLE = "unavailable"  # the job could not be queued (broker down or full)


_OUTCOME_FAILURES = {
    pb.JobOutcome.FAILED: Failure.FAILED,
    pb.JobOutcome.TIMED_OUT: Failure.TIMED_OUT,
    pb.JobOutcome.WORKER_ERROR: Failure.WORKER_ERROR,
}


@dataclasses.dataclass(frozen=True)
class Progress:
    stage: pb.Progress.Stage.ValueType
    elapsed_s: float
    job_id: str = ""  # the compile waited on (Job.job_id)


@dataclasses.dataclass(frozen=True)
class Served:
    """The artifact: from the cache ("hit"), this request's compile ("miss"), or another
    request's compile it waited on ("merged"). It holds the stored (encoded, verified) bytes:
    Get sends them as they are, Compile decodes them chunk by chunk as they are sent (a hit
    never holds the whole artifact)."""

    key: str
    entry: pb.EntryMeta
    stored: bytes
    source: str
    timings: pb.MissTimings | None = None  # "miss" and "merged": the worker's account
    job_id: str = ""  # "miss" and "merged": the compile's job

    def chunks(self, chunk_bytes: int = Codec.CHUNK_BYTES) -> Iterator[bytes]:
        return Codec().chunks(self.stored, self.entry.size, chunk_bytes)


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


@dataclasses.dataclass
class _Claims:
    """The job's claim this request took last (its token), and whether it handed it to a
    worker."""

    token: str = ""  # the claim's, while this request holds it
    queued: bool = False


@dataclasses.dataclass
class _Wait:
    """One request's wait on its job: what it queues again if the job is lost, and how it
    counts ("miss": this request queued it, "merged": another one did)."""

    job: pb.Job
    payload: bytes
    pool: str
    started: float  # time.monotonic() when the request came
    is_active: Callable[[], bool]  # False once the client has gone
    claims: _Claims
    waiter: str  # this request's id in the job's waiter set
    source: str = "miss"


class _NotQueued(TorchfarmError):
    """Posting or queueing a claimed job failed."""


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
        self.hits = HitLedger(store)
        self.recent = RecentIndex(lambda key: store.artifacts.entries(key, usage=False))

    def lookup(
        self, key: str, private: bool, tenant: str, for_ask: bool = False, fresh: bool = False
    ) -> tuple[str, list[pb.EntryMeta]]:
        """The key the tenant meant (its own, derived, for a private lookup) and the entries
        under it that the tenant may see, newest first: as the ask path reads them
        (`for_ask`: this gateway's recent read unless `fresh`, without usage;
        gateway/recent_index.py), or from the store with their hits filled in."""
        if private:
            key = private_key(key, tenant)
        found = self.recent.entries(key, fresh) if for_ask else self.store.artifacts.entries(key)
        return key, [e for e in found if not e.private or e.tenant == tenant]

    def explain(self, ask: pb.Ask, tenant: str) -> pb.MissExplanation:
        """Why `ask` found nothing, against the nearest entry the tenant may see."""
        return explain.explain(self.store, ask, tenant)

    def manifest(self, ask: pb.Ask, tenant: str) -> pb.Manifest | None:
        """On a hit of a program's head: the graphs to prefetch (None: nothing to send)."""
        return prefetch.manifest(
            self.store.programs, lambda k, p, t: self.lookup(k, p, t, for_ask=True), ask, tenant
        )

    def record_program(self, ask: pb.Ask, tenant: str, digest: str) -> None:
        """`ask` was served entry `digest`: remember it in its program, for the next run."""
        prefetch.record(self.store.programs, ask, tenant, digest)

    def get(self, ask: pb.Ask, tenant: str, request_id: str, max_stored: int = 0) -> Served | None:
        """Get's hit: the newest entry the tenant may see whose guards hold on `ask.sizes`
        (with `ask.digest`: that entry, whatever the sizes, for a prefetch), verified; None is
        a miss. The client still checks the signature and the guards on its own inputs. The
        entries come from this gateway's recent read; before a miss is answered they are
        read again, so an entry stored since is never compiled twice. `max_stored`: raise
        TooLarge, serving nothing, where the entry's stored bytes are more (or unknown)."""
        for fresh in (False, True):
            key, entries = self.lookup(ask.key, ask.private, tenant, for_ask=True, fresh=fresh)
            for entry in entries:
                held = entry.digest == ask.digest if ask.digest else _holds(entry.guards, ask.sizes)
                if not held:
                    continue
                if max_stored and not 0 < entry.stored_bytes <= max_stored:
                    raise TooLarge(entry.stored_bytes)
                stored = self.store.artifacts.stored(key, entry)
                if stored is None:
                    log.warning(
                        "dropped corrupt or missing blob %s of %s", entry.digest[:16], key[:16]
                    )
                    continue
                extra = {"request_id": request_id, "tenant": tenant, "key": key}
                log.info("hit %s for %s: %s", key[:16], tenant, ask.label, extra=extra)
                self._count_hit(key, entry)
                return Served(key, entry, stored, "hit")
        return None

    def _count_hit(self, key: str, entry: pb.EntryMeta) -> None:
        """The entry's usage and the counters: into the ledger, written with other hits."""
        self.hits.add(key, entry)
        metrics.RESULTS.labels("hit").inc()
        metrics.BYTES_SERVED.inc(entry.size)

    def compile(self, call: CompileCall, is_active: Callable[[], bool]) -> Iterator[Event]:
        """Serve the request's artifact, compiling it if need be; ends with Served or Failed."""
        request, tenant = call.request, call.tenant
        started = time.monotonic()
        key = cache_key(
            request.graph,
            request.target,
            call.options,
            tenant if request.private else None,
            request.descriptor,
        )
        job = pb.Job(
            key=key,
            job_id=job_id(
                key,
                request.size_hints,
                request.float_hints,
                request.graph if request.descriptor else b"",
            ),
            descriptor=request.descriptor,
            target=request.target,
            options=call.options,
            size_hints=request.size_hints,
            float_hints=request.float_hints,
            tenant=tenant,
            private=request.private,
            label=request.label,
            request_id=call.request_id,
        )
        extra = {"request_id": call.request_id, "tenant": tenant, "key": key}

        hit = self._cached(key, request.digest)
        if hit is not None:
            entry, stored = hit
            log.info("hit %s for %s: %s", key[:16], tenant, request.label, extra=extra)
            self._count_hit(key, entry)
            yield Served(key, entry, stored, "hit")
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
                "; ".join(f"{name} ({state.describe})" for name, state in sorted(pools.items()))
                or "none"
            )
            yield Failed(
                Failure.NO_POOL,
                f"no pool serves target {describe(request.target)} (pool {pool}). "
                f"Pools available: {served}",
            )
            return
        unable = pools[pool].cannot_compile()
        if unable:  # its workers failed their canary: queueing would wait for nothing
            yield Failed(Failure.UNAVAILABLE, unable)
            return
        try:
            with self._waiting_on(job.job_id) as waiter, self._claims(job) as claims:
                wait = _Wait(job, request.graph, pool, started, is_active, claims, waiter)
                yield from self._claim_and_wait(wait)
        except OutOfMemoryError as e:  # a claim or a queue write refused: compile locally
            log.warning("Redis is at its memory limit: %s not queued: %s", job.job_id[:16], e)
            yield Failed(Failure.UNAVAILABLE, f"the farm's Redis is at its memory limit: {e}")

    def _claim_and_wait(self, wait: _Wait) -> Iterator[Event]:
        job, pool = wait.job, wait.pool
        claimed = self._claim(job, wait.claims)
        refused = self._over_tenant_limit(job)
        if refused:
            yield Failed(Failure.TENANT_LIMIT, refused)
            return
        try:
            # Not posted: a run of the job ended since the claim (its outcome is waited on).
            queued = claimed and self._queue(wait)
        except _NotQueued as e:
            yield Failed(Failure.UNAVAILABLE, str(e))
            return
        wait.source = "miss" if queued else "merged"
        if queued:
            self.store.counters.count(pool, misses=1)
        else:
            self.store.counters.count(pool, merges=1)
        metrics.RESULTS.labels(wait.source).inc()
        log.info(
            "%s %s for %s: %s",
            wait.source,
            job.key[:16],
            job.tenant,
            job.label,
            extra=_log_fields(job, pool),
        )
        yield from self._wait(wait)

    @contextlib.contextmanager
    def _claims(self, job: pb.Job) -> Iterator[_Claims]:
        """The one place a claim is given back, however the request ends: a claim it took and
        did not hand to a worker (refused, queueing failed, any error); and, on an error, one it
        handed off too when no other client waits for the job (the worker would only skip it:
        its tenant's slot is free at once). Other waiters keep their claim: they watch its
        job's liveness. A cancelled request releases nothing (its job still counts against its
        tenant until a worker skips it)."""
        claims = _Claims()
        try:
            yield claims
        except Exception:
            if claims.token and claims.queued and self._waiting_without(job) == 0:
                self._release(job, claims.token)
            raise
        finally:
            if claims.token and not claims.queued:
                self._release(job, claims.token)

    def _waiting_without(self, job: pb.Job) -> int:
        """The job's waiters other than this request (whose id is still in the set); -1 if
        that cannot be read."""
        try:
            return self.store.jobs.waiting(job.job_id) - 1
        except Exception:
            return -1

    @contextlib.contextmanager
    def _waiting_on(self, job: str) -> Iterator[str]:
        """Count this request among the job's waiters while it waits (a worker skips a job
        whose waiters are all gone); leave however the wait ends, cancellation included."""
        waiter = uuid.uuid4().hex
        self.store.jobs.join(job, waiter, WAITER_TTL_S)
        try:
            yield waiter
        finally:
            with contextlib.suppress(Exception):  # Redis gone: the waiter expires by itself
                self.store.jobs.leave(job, waiter)

    def _over_tenant_limit(self, job: pb.Job) -> str:
        """Why the tenant may not have this job compiled now ('' if it may): it already has
        TORCHFARM_TENANT_MAX_COMPILES other jobs queued or running, on any gateway."""
        limit = self.tenant_max_compiles
        if not limit:
            return ""
        count = self.store.jobs.take_tenant_slot(job.tenant, job.job_id, limit, self._claim_ttl)
        if count is None:
            return ""
        return (
            f"tenant {job.tenant or '(open farm)'} already has {count} compiles queued or "
            f"running (limit {limit}); retry when one finishes"
        )

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
        stored = artifacts.stored(key, entry)
        if stored is None:
            log.warning("dropped corrupt or missing blob %s of %s", entry.digest[:16], key[:16])
            return None
        return entry, stored

    @property
    def _claim_ttl(self) -> int:
        return int(self.compile_timeout_s) + 60

    def _claim(self, job: pb.Job, claims: _Claims) -> bool:
        """Single flight: True if this request compiles the job, False if it merges."""
        token = self.store.jobs.claim(job.job_id, self._claim_ttl)
        if token is None:
            return False
        claims.token, claims.queued = token, False
        return True

    def _queue(self, wait: _Wait) -> bool:
        """Post the payload and queue the claimed job (handing the claim to a worker); False,
        queueing nothing, where the claim is no longer this request's (a run of the job ended
        since it was taken: see JobBoard.post). On any failure raise _NotQueued (the claim
        goes back as the request ends: see _claims)."""
        job, claims = wait.job, wait.claims
        try:
            if not self.store.jobs.post(job.job_id, claims.token, wait.payload):
                claims.token = ""
                return False
            job.queued_at = time.time()
            self.enqueue(job, wait.pool)
        except Exception as e:
            log.warning(
                "could not queue %s: %s", job.key[:16], e, extra=_log_fields(job, wait.pool)
            )
            raise _NotQueued(f"the farm could not queue the compile: {e}") from e
        claims.queued = True
        return True

    def _release(self, job: pb.Job, token: str) -> None:
        """Give this request's claim back, if it still holds it (its waiters hear it at once);
        a Redis at its memory limit still takes it."""
        try:
            self.store.jobs.release(job.job_id, token)
        except Exception as e:  # the broker is gone: the claim expires by itself
            log.warning("could not release the claim of %s: %s", job.job_id[:16], e)

    def _wait(self, wait: _Wait) -> Iterator[Event]:
        job, pool = wait.job, wait.pool
        deadline = wait.started + self.compile_timeout_s
        next_progress = next_check = 0.0
        told = None  # the stage the client last heard: a change is told at once
        attempt = ("", 0.0)  # the claim token waited on, and since when (the broker's clock)
        with self.store.jobs.watch(job.job_id) as watch:
            while wait.is_active():
                state = self.store.jobs.state(job.job_id)
                ended = (
                    None
                    if state.outcome is None
                    else self._ended(job, state.outcome, pool, wait.source)
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
                if state.claim != attempt[0]:
                    attempt = (state.claim, self.store.jobs.now())
                # The compiler vanished without an outcome (released, abandoned, its worker
                # died: no heartbeat, or its message was lost in the queue), or its artifact is
                # gone: take over. Progress ticks never hide a dead job.
                lost = False
                if state.queued and now >= next_check:
                    next_check = now + LIVENESS_EVERY_S
                    live = self.store.pools.live().get(pool)
                    if live is None:
                        yield Failed(
                            Failure.UNAVAILABLE, f"no worker of pool {pool} is left to compile it"
                        )
                        return
                    lost = live.took_nothing_since(attempt[1], QUEUE_GRACE_S)
                stranded = state.orphaned or lost
                if stranded and self.store.jobs.take_over(job.job_id, state):
                    log.warning(
                        "job of %s lost its worker: queued again",
                        job.key[:16],
                        extra=_log_fields(job, pool),
                    )
                    state = dataclasses.replace(state, claim="")
                if not state.claimed and self._claim(job, wait.claims):
                    try:
                        self._queue(wait)
                    except _NotQueued as e:
                        yield Failed(Failure.UNAVAILABLE, str(e))
                        return
                if now >= next_progress or state.stage != told:
                    self._refresh(job, wait.waiter)
                    yield Progress(state.stage, now - wait.started, job.job_id)
                    next_progress, told = now + PROGRESS_EVERY_S, state.stage
                watch.wait(max(0.0, min(next_progress, deadline) - time.monotonic()))

    def _refresh(self, job: pb.Job, waiter: str) -> None:
        """Count this waiter for another WAITER_TTL_S; bookkeeping only: a Redis at its memory
        limit skips it (the job then looks abandoned a little early, never stranded)."""
        try:
            self.store.jobs.join(job.job_id, waiter, WAITER_TTL_S)
        except OutOfMemoryError:
            log.warning("Redis is at its memory limit: waiter of %s not refreshed", job.job_id)

    def _ended(self, job: pb.Job, outcome: pb.JobOutcome, pool: str, source: str) -> Event | None:
        """The event that ends the wait; None if the stored artifact is already gone, or the
        job was abandoned after this request joined it (then it is queued again)."""
        if outcome.kind == pb.JobOutcome.ABANDONED:
            return None
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
        entry, stored = hit
        saved = entry.compile_seconds if source == "merged" else 0.0
        self.store.counters.count(pool, bytes_served=entry.size, compile_seconds_saved=saved)
        metrics.BYTES_SERVED.inc(entry.size)
        if source == "miss":  # the job id as an exemplar: from a slow bucket to its logs
            metrics.COMPILE_SECONDS.labels(pool, job.options.mode).observe(
                entry.compile_seconds, exemplar={"job_id": job.job_id}
            )
        return Served(job.key, entry, stored, source, outcome.timings, job.job_id)


def _log_fields(job: pb.Job, pool: str) -> dict[str, str]:
    """The `extra` of a log line about a job's compile (logs.FIELDS)."""
    return {
        "request_id": job.request_id,
        "job_id": job.job_id,
        "tenant": job.tenant,
        "key": job.key,
        "pool": pool,
    }


def _holds(guards: pb.ShapeGuards, sizes) -> bool:
    """Whether an entry's guards hold on the sizes a client sent; a malformed tree, or one
    over more inputs than sizes, holds nowhere (the gateway evaluates data, never code)."""
    try:
        return shape_guards.evaluate(guards, list(sizes))
    except ValueError:
        return False
