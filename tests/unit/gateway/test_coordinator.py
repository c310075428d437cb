"""The coordinator against a bare redis-server, without gRPC or Celery: the queue is a list,
and the "worker" is this test writing to the job board as a worker does."""

import threading
import time

import pytest
import redis

from tests.unit.gateway.conftest import TARGET
from torchfarm.cache import keys
from torchfarm.cache.artifacts import digest_of
from torchfarm.cache.pools import Readiness
from torchfarm.cache.store import Store
from torchfarm.contract.cache_key import cache_key, job_id, private_key
from torchfarm.contract.options import canonical_options
from torchfarm.contract.pools import pool_name
from torchfarm.gateway import coordinator as coordinator_module
from torchfarm.gateway.coordinator import (
    CompileCall,
    Coordinator,
    Failed,
    Failure,
    Progress,
    Served,
)
from torchfarm.proto import torchfarm_pb2 as pb

ARTIFACT = b"compiled bytes " * 100
GUARDED = pb.ShapeGuards(  # t0 > 2
    all=[
        pb.GuardExpr(
            apply=pb.GuardApply(
                op=pb.GuardApply.GT, args=[pb.GuardExpr(input=0), pb.GuardExpr(constant=2)]
            )
        )
    ]
)


class Queue:
    """The injected enqueue: records (job, pool) and lets a test wait for the next job."""

    def __init__(self):
        self.jobs: list[tuple[pb.Job, str]] = []
        self.arrived = threading.Semaphore(0)

    def __call__(self, job: pb.Job, pool: str) -> None:
        self.jobs.append((job, pool))
        self.arrived.release()

    def next(self) -> pb.Job:
        assert self.arrived.acquire(timeout=30), "no job was enqueued"
        return self.jobs[-1][0]


def _call(graph=b"graph payload", tenant="alice", private=False, digest="", hints=None):
    request = pb.CompileRequest(
        graph=graph, target=TARGET, private=private, digest=digest, size_hints=hints or {"s0": 4}
    )
    return CompileCall(request, canonical_options(request.options), tenant, "rid")


def _run(coordinator: Coordinator, call: CompileCall) -> list:
    return list(coordinator.compile(call, lambda: True))


def _bytes(served: Served) -> bytes:
    return b"".join(served.chunks())


def _store_as_worker(store: Store, job: pb.Job, data: bytes = ARTIFACT, **meta) -> None:
    store.jobs.take_lease(job.job_id, "worker")  # its run (finish drops the lease)
    store.jobs.set_stage(job.job_id, pb.Progress.COMPILING)
    entry = store.artifacts.put(
        job.key, data, pb.EntryMeta(tenant=job.tenant, private=job.private, **meta)
    )
    timings = pb.MissTimings(handoff_s=0.25, compile_s=meta.get("compile_seconds", 0.0))
    store.jobs.finish(
        job.job_id,
        pb.JobOutcome(kind=pb.JobOutcome.STORED, digest=entry.digest, timings=timings),
    )


def _in_background(events: list, coordinator: Coordinator, call: CompileCall) -> threading.Thread:
    def run():
        for event in coordinator.compile(call, lambda: True):
            events.append(event)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _until_waiting(events: list) -> None:
    """Until the request waits on a compile (its first progress event)."""
    deadline = time.monotonic() + 30
    while not any(isinstance(e, Progress) for e in events):
        assert time.monotonic() < deadline, "the request never started waiting"
        time.sleep(0.01)


def test_a_miss_is_queued_once_then_served_and_the_repeat_is_a_hit(store):
    queue = Queue()
    coordinator = Coordinator(store, queue, compile_timeout_s=60)
    first, merged = [], []
    waiting = _in_background(first, coordinator, _call())
    job = queue.next()
    _until_waiting(first)  # its first progress read while the job is queued, not after
    second = _in_background(merged, coordinator, _call())  # same job: single flight
    _until_waiting(merged)
    _store_as_worker(store, job, compile_seconds=3.0)
    waiting.join(30)
    second.join(30)
    assert len(queue.jobs) == 1
    assert job.key == cache_key(b"graph payload", TARGET, pb.Options())
    assert job.tenant == "alice" and job.request_id == "rid" and dict(job.size_hints) == {"s0": 4}
    assert queue.jobs[0][1] == pool_name(TARGET)
    assert isinstance(first[0], Progress) and first[0].stage == pb.Progress.QUEUED
    assert [type(e) for e in first][-1] is Served and first[-1].source == "miss"
    assert merged[-1].source == "merged" and _bytes(merged[-1]) == ARTIFACT
    # the worker's account of the miss reaches every waiter (bench/warm_start.py prints it)
    assert job.queued_at > 0
    assert first[-1].timings.handoff_s == merged[-1].timings.handoff_s == 0.25
    assert first[-1].timings.compile_s == 3.0
    # one job id for the compile: in every progress and the artifact, for both waiters
    heard = {e.job_id for e in first + merged}
    assert heard == {job.job_id} and len(job.job_id) == 64
    again = _run(coordinator, _call())
    assert len(again) == 1 and again[0].source == "hit" and _bytes(again[0]) == ARTIFACT
    assert again[0].job_id == ""  # a hit compiles nothing
    coordinator.hits.flush()
    assert store.counters.farm()["hits"] == 1 and store.counters.farm()["misses"] == 1


def test_outcomes_become_typed_failures_and_lasting_ones_are_remembered(store):
    queue = Queue()
    coordinator = Coordinator(store, queue, compile_timeout_s=60)
    for kind, failure in [
        (pb.JobOutcome.TIMED_OUT, Failure.TIMED_OUT),
        (pb.JobOutcome.WORKER_ERROR, Failure.WORKER_ERROR),
        (pb.JobOutcome.FAILED, Failure.FAILED),
    ]:
        events: list = []
        call = _call(graph=f"graph {kind}".encode())
        thread = _in_background(events, coordinator, call)
        job = queue.next()
        store.jobs.finish(job.job_id, pb.JobOutcome(kind=kind, error="why"), remember_s=60)
        thread.join(30)
        assert events[-1] == Failed(failure, "compile failed on the farm: why")
    enqueued = len(queue.jobs)
    remembered = _run(coordinator, _call(graph=f"graph {pb.JobOutcome.FAILED}".encode()))
    assert remembered[-1].kind is Failure.FAILED and len(queue.jobs) == enqueued


def test_the_waiter_hears_stages_and_takes_over_a_vanished_claim(store):
    queue = Queue()
    coordinator = Coordinator(store, queue, compile_timeout_s=60)
    events: list = []
    thread = _in_background(events, coordinator, _call())
    job = queue.next()
    store.jobs.set_stage(job.job_id, pb.Progress.AUTOTUNING)
    store.jobs.release(job.job_id)  # the worker died without an outcome
    retried = queue.next()
    assert retried == job
    _store_as_worker(store, retried)
    thread.join(30)
    assert events[-1].source == "miss"
    assert all(isinstance(e, Progress) for e in events[:-1])


def test_a_run_that_ends_between_a_waiters_claim_and_its_post_keeps_its_outcome(store, monkeypatch):
    """The race of a CI run (docs/benchmarks.md, 0842f63): a waiter claims a job whose claim
    was given back, and before its post the job's run ends (outcome written, claim dropped).
    The post must neither clear that outcome nor queue the job again: the waiter is served
    what the run stored, and the job is compiled once."""
    queue = Queue()
    coordinator = Coordinator(store, queue, compile_timeout_s=60)
    events: list = []
    thread = _in_background(events, coordinator, _call())
    job = queue.next()
    claim = store.jobs.claim

    def claim_then_the_run_ends(job_id: str, ttl_s: int) -> str | None:
        token = claim(job_id, ttl_s)
        if token is not None:
            _store_as_worker(store, job)
        return token

    monkeypatch.setattr(store.jobs, "claim", claim_then_the_run_ends)
    store.jobs.release(job.job_id)  # its claim given back while its run goes on
    thread.join(30)
    assert isinstance(events[-1], Served) and _bytes(events[-1]) == ARTIFACT
    assert len(queue.jobs) == 1


def test_a_waiter_takes_over_a_job_whose_worker_stopped_beating(store, monkeypatch):
    """The worker took the job (its stage is past QUEUED) and died without an outcome or a
    release (a Celery worker that exited on a full Redis): its claim lives on, but its
    heartbeat expires, and the waiter queues the job again instead of waiting for the claim's
    expiry (finding 2 of issue 27)."""
    monkeypatch.setattr(coordinator_module, "PROGRESS_EVERY_S", 0.2)  # a look every 0.2 s
    queue = Queue()
    coordinator = Coordinator(store, queue, compile_timeout_s=600)
    events: list = []
    thread = _in_background(events, coordinator, _call())
    job = queue.next()
    assert store.jobs.take_lease(job.job_id, "worker")  # taken, lease fresh
    store.jobs.set_stage(job.job_id, pb.Progress.COMPILING)
    time.sleep(0.5)
    assert len(queue.jobs) == 1, "a job with a fresh heartbeat was queued again"
    store.jobs.redis.delete(keys.alive(job.job_id))  # the worker is gone: no more beats
    retried = queue.next()
    assert retried == job and len(queue.jobs) == 2
    _store_as_worker(store, retried)
    thread.join(30)
    assert events[-1].source == "miss"


def test_a_live_lease_keeps_a_long_compile_its_own(store):
    with store.jobs.lease("j1", "worker") as leased:
        assert leased
        assert not store.jobs.state("j1").orphaned  # nothing claimed
        store.jobs.claim("j1", 60)
        store.jobs.set_stage("j1", pb.Progress.COMPILING)
        assert store.jobs.state("j1").alive and not store.jobs.state("j1").orphaned
        assert not store.jobs.take_over("j1", store.jobs.state("j1"))
    assert not store.jobs.state("j1").alive  # the run ended: its lease went with it
    orphaned = store.jobs.state("j1")
    assert orphaned.orphaned
    assert store.jobs.take_over("j1", orphaned)
    assert not store.jobs.state("j1").claimed
    assert not store.jobs.take_over("j1", orphaned)  # once


def test_a_full_redis_does_not_end_a_wait(store, monkeypatch):
    """The waiter's refresh is bookkeeping: at maxmemory it is skipped, and the wait goes on
    to the artifact."""
    monkeypatch.setattr(coordinator_module, "PROGRESS_EVERY_S", 0.2)  # a refresh every 0.2 s
    queue = Queue()
    coordinator = Coordinator(store, queue, compile_timeout_s=60)
    events: list = []
    used = store.jobs.redis.info("memory")["used_memory"]
    thread = _in_background(events, coordinator, _call())
    job = queue.next()
    _until_waiting(events)
    store.jobs.redis.config_set("maxmemory-policy", "noeviction")
    store.jobs.redis.config_set("maxmemory", used // 2)
    try:
        time.sleep(0.5)  # two refreshes refused
        assert thread.is_alive()
    finally:
        store.jobs.redis.config_set("maxmemory", 0)
    _store_as_worker(store, job)
    thread.join(30)
    assert events[-1].source == "miss"


def test_an_uncached_artifact_reaches_its_waiters(store):
    queue = Queue()
    coordinator = Coordinator(store, queue, compile_timeout_s=60)
    events: list = []
    thread = _in_background(events, coordinator, _call())
    job = queue.next()
    meta = pb.EntryMeta(compile_seconds=1.5)
    meta.digest, meta.size = digest_of(ARTIFACT), len(ARTIFACT)
    store.jobs.finish(
        job.job_id,
        pb.JobOutcome(kind=pb.JobOutcome.UNCACHED, digest=meta.digest),
        uncached=(meta, ARTIFACT),
    )
    thread.join(30)
    assert events[-1].source == "miss" and _bytes(events[-1]) == ARTIFACT
    assert not store.artifacts.keys()


def test_no_pool_and_the_tenant_limit_are_refused(store):
    coordinator = Coordinator(store, Queue(), compile_timeout_s=60, tenant_max_compiles=1)
    other = pb.CompileRequest(graph=b"g", target=pb.Target(device="cuda", torch_version="2.13"))
    refused = _run(coordinator, CompileCall(other, pb.Options(mode="default"), "alice", "r"))
    assert refused[-1].kind is Failure.NO_POOL and "a test pool" in refused[-1].message
    events: list = []
    thread = _in_background(events, coordinator, _call())
    job = coordinator.enqueue.next()
    limited = _run(coordinator, _call(graph=b"another graph"))
    assert limited[-1].kind is Failure.TENANT_LIMIT
    _store_as_worker(store, job)
    thread.join(30)
    assert events[-1].source == "miss"


def test_a_private_entry_is_seen_by_its_tenant_only(store):
    queue = Queue()
    coordinator = Coordinator(store, queue, compile_timeout_s=60)
    events: list = []
    thread = _in_background(events, coordinator, _call(private=True))
    _store_as_worker(store, queue.next(), guards=GUARDED)
    thread.join(30)
    public = cache_key(b"graph payload", TARGET, pb.Options())
    mine = events[-1].key
    assert mine == private_key(public, "alice") != public
    key, entries = coordinator.lookup(public, True, "alice")
    assert key == mine and [e.guards for e in entries] == [GUARDED]
    for private in (True, False):
        key, entries = coordinator.lookup(public, private, "bob")
        assert key != mine and not entries
    assert coordinator.lookup(mine, False, "bob") == (mine, [])  # naming alice's key: nothing


def test_without_a_digest_only_an_unguarded_entry_is_served(store):
    # A guarded entry may not hold for the client's sizes; only the client can tell (its
    # digest). An unguarded entry holds everywhere.
    queue = Queue()
    coordinator = Coordinator(store, queue, compile_timeout_s=60)
    key = cache_key(b"graph payload", TARGET, pb.Options())
    guarded = store.artifacts.put(key, ARTIFACT, pb.EntryMeta(tenant="alice", guards=GUARDED))
    events: list = []
    thread = _in_background(events, coordinator, _call())
    _store_as_worker(store, queue.next(), b"unguarded bytes")
    thread.join(30)
    assert events[-1].source == "miss"
    again = _run(coordinator, _call())
    assert again[-1].source == "hit" and _bytes(again[-1]) == b"unguarded bytes"
    chosen = _run(coordinator, _call(digest=guarded.digest))
    assert chosen[-1].source == "hit" and _bytes(chosen[-1]) == ARTIFACT


class FailingQueue(Queue):
    """Refuses the first `failures` jobs, as Celery's send does when the broker is full or
    unreachable; `gate` (if set) holds the refusal until the test opens it."""

    def __init__(self, failures: int = 1, gate: threading.Event | None = None):
        super().__init__()
        self.failures, self.gate, self.refused = failures, gate, 0

    def __call__(self, job: pb.Job, pool: str) -> None:
        if self.refused < self.failures:
            self.refused += 1
            if self.gate is not None:
                assert self.gate.wait(30)
            raise ConnectionError("OOM command not allowed when used memory > 'maxmemory'")
        super().__call__(job, pool)


def _claimed(store: Store, job_id: str) -> bool:
    return store.jobs.state(job_id).claimed


def test_a_failed_enqueue_releases_the_claim_and_the_next_request_compiles(store):
    queue = FailingQueue()
    coordinator = Coordinator(store, queue, compile_timeout_s=60)
    refused = _run(coordinator, _call())
    assert refused[-1].kind is Failure.UNAVAILABLE and "maxmemory" in refused[-1].message
    job_id = job_id_of(_call())
    assert not _claimed(store, job_id) and store.jobs.abandoned(job_id)
    events: list = []
    thread = _in_background(events, coordinator, _call())
    _store_as_worker(store, queue.next())  # queued at once: no claim left to wait out
    thread.join(30)
    assert events[-1].source == "miss" and _bytes(events[-1]) == ARTIFACT


def test_a_merged_waiter_takes_over_when_the_claimant_cannot_queue(store):
    gate = threading.Event()
    queue = FailingQueue(gate=gate)
    coordinator = Coordinator(store, queue, compile_timeout_s=60)
    claimant, merged = [], []
    first = _in_background(claimant, coordinator, _call())
    while not _claimed(store, job_id_of(_call())):
        time.sleep(0.01)
    second = _in_background(merged, coordinator, _call())
    _until_waiting(merged)
    gate.set()  # the claimant's enqueue fails now: its claim is released and announced
    first.join(30)
    assert claimant[-1].kind is Failure.UNAVAILABLE
    _store_as_worker(store, queue.next())  # the merged waiter queued it again
    second.join(30)
    assert _bytes(merged[-1]) == ARTIFACT and len(queue.jobs) == 1


def test_a_job_is_abandoned_once_its_last_waiter_leaves_or_goes_silent(store, monkeypatch):
    monkeypatch.setattr(coordinator_module, "PROGRESS_EVERY_S", 0.2)  # a cancel heard in 0.2 s
    queue = Queue()
    coordinator = Coordinator(store, queue, compile_timeout_s=60)
    active = {"first": True, "second": True}
    events: list = []
    threads = [
        threading.Thread(
            target=lambda name=name: events.extend(
                coordinator.compile(_call(), lambda: active[name])
            ),
            daemon=True,
        )
        for name in active
    ]
    for thread in threads:
        thread.start()
    job = queue.next()
    deadline = time.monotonic() + 30
    while store.jobs.redis.zcard(keys.waiters(job.job_id)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    active["first"] = False  # the first client cancelled its RPC
    threads[0].join(30)
    assert not store.jobs.abandoned(job.job_id)  # the second one still waits
    active["second"] = False
    threads[1].join(30)
    assert store.jobs.abandoned(job.job_id)
    assert _claimed(store, job.job_id)  # still queued: the worker skips it when it comes
    store.jobs.join("another job", "a hung gateway's waiter", ttl_s=0.2)
    assert not store.jobs.abandoned("another job")
    time.sleep(0.3)  # no refresh: gone, as when its gateway stopped
    assert store.jobs.abandoned("another job")


def test_the_tenant_limit_counts_queued_jobs_not_open_requests(store):
    queue = Queue()
    coordinator = Coordinator(store, queue, compile_timeout_s=60, tenant_max_compiles=1)
    cancelled = list(coordinator.compile(_call(), lambda: False))  # sent, then cancelled
    assert not any(isinstance(e, Failed) for e in cancelled)
    job = queue.next()
    limited = _run(coordinator, _call(graph=b"a graph sent a few seconds later"))
    assert limited[-1].kind is Failure.TENANT_LIMIT and "queued or running" in limited[-1].message
    assert not _claimed(store, job_id_of(_call(graph=b"a graph sent a few seconds later")))
    other: list = []
    bobs = _in_background(other, coordinator, _call(graph=b"bob's graph", tenant="bob"))
    _store_as_worker(store, queue.next())  # bob has a slot of his own
    bobs.join(30)
    assert other[-1].source == "miss"
    store.jobs.finish(job.job_id, pb.JobOutcome(kind=pb.JobOutcome.ABANDONED))  # the skip
    later: list = []
    thread = _in_background(later, coordinator, _call(graph=b"a graph sent a few seconds later"))
    _store_as_worker(store, queue.next())
    thread.join(30)
    assert later[-1].source == "miss"


def test_an_abandoned_outcome_sends_a_new_waiter_back_to_the_queue(store):
    queue = Queue()
    coordinator = Coordinator(store, queue, compile_timeout_s=60)
    events: list = []
    thread = _in_background(events, coordinator, _call())
    job = queue.next()
    # a worker judged the job abandoned just before this request joined it
    store.jobs.finish(job.job_id, pb.JobOutcome(kind=pb.JobOutcome.ABANDONED))
    _store_as_worker(store, queue.next())
    thread.join(30)
    assert events[-1].source == "miss" and len(queue.jobs) == 2


def job_id_of(call: CompileCall) -> str:
    key = cache_key(call.request.graph, TARGET, call.options)
    return job_id(key, call.request.size_hints, call.request.float_hints)


def test_a_pool_whose_workers_failed_their_canary_is_refused_at_once_a_starting_one_queues(store):
    # The test pool's worker fails its canary (a later heartbeat of the same worker).
    error = "CompileFailed: compile child failed (exit 1):\nTraceback ...\nModuleNotFoundError: x"
    store.pools.register(
        pool_name(TARGET), "w1", {"describe": "a test pool"}, Readiness("failed", error, 1.0)
    )
    coordinator = Coordinator(store, Queue(), compile_timeout_s=60, tenant_max_compiles=0)
    refused = _run(coordinator, _call())
    assert refused[-1].kind is Failure.UNAVAILABLE
    assert f"pool {pool_name(TARGET)} cannot compile" in refused[-1].message
    assert "ModuleNotFoundError: x" in refused[-1].message
    assert not coordinator.enqueue.jobs
    # Another worker of the pool still running its canary: the job queues for it.
    store.pools.register(pool_name(TARGET), "w2", {"describe": "a test pool"}, Readiness())
    events: list = []
    thread = _in_background(events, coordinator, _call())
    job = coordinator.enqueue.next()
    _store_as_worker(store, job)
    thread.join(30)
    assert events[-1].source == "miss"


def test_an_error_after_the_claim_releases_it_and_the_tenants_slot(store, monkeypatch):
    """An error while the claimant waits (here the broker drops the state read) gives its
    claim back when no other client waits for the job, so the tenant's next graph is not
    refused for a job nobody waits for (issue 27, finding 2)."""
    queue = Queue()
    coordinator = Coordinator(store, queue, compile_timeout_s=60, tenant_max_compiles=1)

    def broken(job_id):
        raise redis.ConnectionError("the broker went away")

    monkeypatch.setattr(store.jobs, "state", broken)
    with pytest.raises(redis.ConnectionError):
        _run(coordinator, _call())
    monkeypatch.undo()
    job = queue.next()
    assert not _claimed(store, job.job_id)
    events: list = []
    thread = _in_background(events, coordinator, _call(graph=b"the tenant's next graph"))
    _store_as_worker(store, queue.next())
    thread.join(30)
    assert events[-1].source == "miss"


def test_a_full_redis_refuses_a_new_compile_as_unavailable_and_keeps_no_claim(store):
    """At maxmemory a miss cannot be queued: UNAVAILABLE (the client compiles locally), not an
    error out of the coordinator."""
    used = store.jobs.redis.info("memory")["used_memory"]
    store.jobs.redis.config_set("maxmemory-policy", "noeviction")
    store.jobs.redis.config_set("maxmemory", used // 2)
    try:
        refused = _run(Coordinator(store, Queue(), compile_timeout_s=60), _call())
    finally:
        store.jobs.redis.config_set("maxmemory", 0)
    assert refused[-1].kind is Failure.UNAVAILABLE and "memory limit" in refused[-1].message
    assert not _claimed(store, job_id_of(_call()))


def _beat(store: Store, free_for_s: float) -> None:
    """A heartbeat of the test pool's worker: free for `free_for_s` (-1: all slots busy)."""
    info = {"describe": "a test pool", "free_for_s": free_for_s}
    store.pools.register(pool_name(TARGET), "w1", info, Readiness("ready"))


def test_a_waiter_queues_again_a_job_lost_in_the_queue(store, monkeypatch):
    """The job's message went with a worker that died taking it (a Celery worker ended by a
    full broker): the job stays QUEUED, claimed, with no heartbeat. Before, its waiters got a
    progress tick every second for up to 1,860 s; now, once a worker of the pool reports a
    free slot for QUEUE_GRACE_S while the job waited, a waiter queues it again. A busy pool
    keeps its queue (issue 27, finding 2)."""
    monkeypatch.setattr(coordinator_module, "QUEUE_GRACE_S", 0.5)
    monkeypatch.setattr(coordinator_module, "LIVENESS_EVERY_S", 0.1)
    queue = Queue()
    coordinator = Coordinator(store, queue, compile_timeout_s=600)
    _beat(store, -1)  # every slot busy: the job waits its turn
    events: list = []
    thread = _in_background(events, coordinator, _call())
    job = queue.next()
    time.sleep(1.25)
    _beat(store, -1)
    time.sleep(0.5)
    assert len(queue.jobs) == 1, "a job waiting its turn was queued again"
    _beat(store, 60)  # a free slot for a minute, and the job still untaken: lost
    retried = queue.next()
    assert retried == job and len(queue.jobs) == 2
    _store_as_worker(store, retried)
    thread.join(30)
    assert events[-1].source == "miss"


def test_a_waiter_of_a_pool_whose_workers_are_gone_is_told_to_compile_locally(store, monkeypatch):
    monkeypatch.setattr(coordinator_module, "LIVENESS_EVERY_S", 0.2)
    coordinator = Coordinator(store, Queue(), compile_timeout_s=600)
    events: list = []
    thread = _in_background(events, coordinator, _call())
    coordinator.enqueue.next()
    store.jobs.redis.delete(keys.pool(pool_name(TARGET)))  # its workers' heartbeats expired
    thread.join(30)
    assert events[-1].kind is Failure.UNAVAILABLE and "no worker of pool" in events[-1].message
