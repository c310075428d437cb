"""The job board, on the broker's Redis: single-flight claims, queued payloads, each job's
stage and outcome, the failure memory, and a per-job notification channel.

A worker publishes on keys.events(job) whenever it changes the job's stage or writes its
outcome; a waiter subscribes first (`watch`) and reads the state second, so it misses
nothing and sleeps until something happens. The outcome is written, the claim dropped and
the notification published in one transaction: a waiter that sees the claim gone also sees
the outcome. A claimant posts its job only while the claim is still its own: a run that ended
in between (its outcome written, the claim dropped) keeps its outcome.

Waiters and tenants are counted here too, so that every gateway sees the same numbers: each
waiting RPC keeps its id in the job's waiter set with an expiry it refreshes (a worker skips
a job whose waiters are all gone), and each tenant's queued and running jobs are a set whose
members leave when their claim does (TORCHFARM_TENANT_MAX_COMPILES counts them). Expiries
are in the Redis server's time, so gateways and workers need no common clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import uuid
from collections.abc import Iterator

import redis

from torchfarm.cache import keys
from torchfarm.cache.artifacts import Codec
from torchfarm.proto import torchfarm_pb2 as pb

JOB_TTL_S = 3600
STAGE_TTL_S = 3600
OUTCOME_TTL_S = 3600
UNCACHED_TTL_S = 600  # long enough for every merged waiter to read it
# A running job's lease: the worker that won it renews keys.alive every ALIVE_TTL_S / 3; a job
# past QUEUED whose lease expired lost its worker (killed, or its Celery process exited).
ALIVE_TTL_S = 15
ERROR_CHARS = 4000

# Count the tenant's jobs that are still claimed (queued or running) and add `job` unless the
# tenant is at its limit: one atomic step, so two gateways cannot both take the last slot.
# KEYS[1]: the tenant's job set. ARGV: now, limit (0: none), job, its expiry, claim prefix.
# Returns -1 if the job counts now (added, or already counted), else the tenant's count.
_TAKE_TENANT_SLOT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if redis.call('EXISTS', ARGV[5] .. member) == 0 then redis.call('ZREM', KEYS[1], member) end
end
if redis.call('ZSCORE', KEYS[1], ARGV[3]) then return -1 end
local count = redis.call('ZCARD', KEYS[1])
if tonumber(ARGV[2]) > 0 and count >= tonumber(ARGV[2]) then return count end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[4]) - tonumber(ARGV[1])))
return -1
"""


# Lua, not MULTI: a Redis at its memory limit refuses every transaction that holds a write
# (7.0), but runs a script whose writes need no memory (DEL, PUBLISH). So a claim goes back
# and a stranded job is taken over even then.
# KEYS: the claim, the events channel. ARGV: the claim's token ("" = whoever holds it).
_RELEASE = """
local held = redis.call('GET', KEYS[1])
if not held or (ARGV[1] ~= '' and held ~= ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', KEYS[2], 'released')
return 1
"""
# KEYS: the claim, stage, heartbeat, outcome, events. ARGV: the claim's token and the stage
# seen, the QUEUED stage (an absent stage key). Drops claim and stage if nothing moved.
_TAKE_OVER = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(redis.call('GET', KEYS[2]) or ARGV[3]) ~= tonumber(ARGV[2]) then return 0 end
if redis.call('EXISTS', KEYS[3], KEYS[4]) > 0 then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('PUBLISH', KEYS[5], 'released')
return 1
"""
# KEYS: the lease. ARGV: the holder's token, the TTL (ms). Renew the lease if it is still the
# holder's, take it again if it lapsed (a broker away for longer than the TTL); 0 if another
# run of the job holds it now.
_RENEW_LEASE = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# KEYS: the claim, payload, stage, outcome, uncached artifact. ARGV: the claim's token, the
# payload, the QUEUED stage, the payload's and the stage's TTL. The payload is written first:
# a Redis at its memory limit refuses it before anything else is touched.
_POST = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[4])
redis.call('SET', KEYS[3], ARGV[3], 'EX', ARGV[5])
redis.call('DEL', KEYS[4], KEYS[5])
return 1
"""
_DROP_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclasses.dataclass(frozen=True)
class JobState:
    """One read of a job: whether someone compiles it, its stage, how it ended (if it did)."""

    claim: str  # the claim's token ("" if none): a new token is a new attempt
    stage: pb.Progress.Stage.ValueType
    outcome: pb.JobOutcome | None
    alive: bool = False  # a worker's heartbeat is fresh

    @property
    def claimed(self) -> bool:
        return bool(self.claim)

    @property
    def queued(self) -> bool:
        """Claimed and waiting in the queue: no worker has taken it (a worker's heartbeat
        starts the moment its task does), and it has not ended."""
        return (
            self.claimed
            and self.outcome is None
            and self.stage == pb.Progress.QUEUED
            and not self.alive
        )

    @property
    def orphaned(self) -> bool:
        """Claimed and taken by a worker, with no outcome and no heartbeat: its worker is
        gone, and nobody will finish it."""
        return (
            self.claimed and self.outcome is None and self.stage != pb.Progress.QUEUED
        ) and not self.alive


class Watch:
    """A subscription to one job's notifications (see JobBoard.watch)."""

    def __init__(self, pubsub: redis.client.PubSub):
        self._pubsub = pubsub

    def wait(self, timeout_s: float) -> bool:
        """Sleep until the job's next notification or `timeout_s`; True if one came."""
        message = self._pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout_s)
        return message is not None


class JobBoard:
    def __init__(self, client: redis.Redis, codec: Codec | None = None):
        self.redis = client
        self.codec = codec or Codec()
        self._release = client.register_script(_RELEASE)
        self._take_over = client.register_script(_TAKE_OVER)
        self._renew_lease = client.register_script(_RENEW_LEASE)
        self._drop_lease = client.register_script(_DROP_LEASE)
        self._post = client.register_script(_POST)

    # ---- single flight -----------------------------------------------------------------
    def claim(self, job: str, ttl_s: int) -> str | None:
        """Claim a compile job; a token if this caller won, None if another holds it."""
        token = uuid.uuid4().hex
        return token if self.redis.set(keys.claim(job), token, nx=True, ex=ttl_s) else None

    def release(self, job: str, token: str = "") -> None:
        """Drop the claim (only if it is still `token`'s, when given) and tell the waiters at
        once, so that one of them (or the next request) takes the job over instead of waiting
        on nothing."""
        self._release(keys=[keys.claim(job), keys.events(job)], args=[token])

    # ---- who waits: waiters per job, jobs per tenant -----------------------------------
    def now(self) -> float:
        """The broker's clock (every expiry and heartbeat here is in it)."""
        seconds, micros = self.redis.time()
        return seconds + micros / 1e6

    def join(self, job: str, waiter: str, ttl_s: float) -> None:
        """Record (or refresh) a waiter of the job; it counts for `ttl_s` from now."""
        expiry = self.now() + ttl_s
        pipe = self.redis.pipeline()
        pipe.zadd(keys.waiters(job), {waiter: expiry})
        pipe.expire(keys.waiters(job), max(1, int(ttl_s) + 1))
        pipe.execute()

    def leave(self, job: str, waiter: str) -> None:
        self.redis.zrem(keys.waiters(job), waiter)

    def waiting(self, job: str) -> int:
        """How many waiters the job has (each counts until it leaves or stops refreshing)."""
        pipe = self.redis.pipeline()
        pipe.zremrangebyscore(keys.waiters(job), "-inf", self.now())
        pipe.zcard(keys.waiters(job))
        return int(pipe.execute()[1])

    def abandoned(self, job: str) -> bool:
        """True if no waiter of the job is left (each left, or stopped refreshing)."""
        return self.waiting(job) == 0

    def take_tenant_slot(self, tenant: str, job: str, limit: int, ttl_s: float) -> int | None:
        """Count `job` among the tenant's queued and running jobs (until its claim is gone);
        None if it counts, else the tenant's count when `limit` (> 0) is reached."""
        now = self.now()
        count = self.redis.eval(
            _TAKE_TENANT_SLOT,
            1,
            keys.tenant_jobs(tenant),
            now,
            limit,
            job,
            now + ttl_s,
            keys.claim(""),
        )
        return None if int(count) < 0 else int(count)

    def post(self, job: str, token: str, payload: bytes) -> bool:
        """Gateway: the payload a worker will compile; the job starts queued, afresh (a stale
        outcome cleared). Only while the claim is still `token`'s: False, writing nothing,
        where a run of the job ended since the claim was taken (its outcome stays) or another
        caller holds the claim now."""
        posted = self._post(
            keys=[
                keys.claim(job),
                keys.job(job),
                keys.stage(job),
                keys.outcome(job),
                keys.uncached(job),
            ],
            args=[token, payload, pb.Progress.QUEUED, JOB_TTL_S, STAGE_TTL_S],
        )
        return bool(posted)

    def payload(self, job: str) -> bytes | None:
        return self.redis.get(keys.job(job))

    # ---- what waiters read -------------------------------------------------------------
    @contextlib.contextmanager
    def watch(self, job: str) -> Iterator[Watch]:
        """Subscribe to the job's notifications; read its state only after entering, so
        nothing that happens in between is missed."""
        pubsub = self.redis.pubsub()
        try:
            pubsub.subscribe(keys.events(job))
            # Wait for the server's confirmation: from here on, every publish reaches us.
            while pubsub.get_message(timeout=5) is None:
                pass
            yield Watch(pubsub)
        finally:
            pubsub.close()

    def state(self, job: str) -> JobState:
        """The claim, stage and outcome, in one round trip. The claim is read first: a
        worker writes the outcome and drops the claim together."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(keys.claim(job))
        pipe.get(keys.stage(job))
        pipe.get(keys.outcome(job))
        pipe.exists(keys.alive(job))
        claim, stage, outcome, alive = pipe.execute()
        return JobState(
            claim=claim.decode() if claim else "",
            stage=pb.Progress.Stage.ValueType(int(stage)) if stage else pb.Progress.QUEUED,
            outcome=pb.JobOutcome.FromString(outcome) if outcome else None,
            alive=bool(alive),
        )

    def outcome(self, job: str) -> pb.JobOutcome | None:
        value = self.redis.get(keys.outcome(job))
        return pb.JobOutcome.FromString(value) if value else None

    def failure(self, job: str) -> str | None:
        """The error of a recent compile of this job that failed by itself (not a timeout or a
        killed child), which another compile would meet again."""
        value = self.redis.get(keys.failed(job))
        return value.decode() if value else None

    def uncached(self, job: str, digest: str) -> tuple[pb.EntryMeta, bytes] | None:
        """The entry and its stored (encoded, verified) bytes a job produced while the cache
        was full, if any; decode them with Codec.chunks."""
        meta, stored = self.redis.hmget(keys.uncached(job), ["meta", "blob"])
        if meta is None or stored is None:
            return None
        entry = pb.EntryMeta.FromString(meta)
        if entry.digest != digest or not self.codec.verify(stored, entry.digest, entry.size):
            return None
        return entry, stored

    # ---- what workers write ------------------------------------------------------------
    def set_stage(self, job: str, stage: pb.Progress.Stage.ValueType) -> None:
        """The job's new stage, told to its waiters."""
        pipe = self.redis.pipeline()
        pipe.set(keys.stage(job), stage, ex=STAGE_TTL_S)
        pipe.publish(keys.events(job), b"stage")
        pipe.execute()

    def take_lease(self, job: str, holder: str) -> str | None:
        """Become the one run of the job: a token if no live run holds its lease, else None.
        A broker redelivers a task whose run outlives its visibility timeout (or consumer
        timeout); the copy finds the lease held and must not compile again."""
        token = f"{holder}/{uuid.uuid4().hex}"
        taken = self.redis.set(keys.alive(job), token, nx=True, px=int(ALIVE_TTL_S * 1000))
        return token if taken else None

    def lease_holder(self, job: str) -> str:
        """Who runs the job ('' if nobody): the holder its run named, before the '/'."""
        held = self.redis.get(keys.alive(job))
        return held.decode().rpartition("/")[0] if held else ""

    @contextlib.contextmanager
    def lease(self, job: str, holder: str) -> Iterator[bool]:
        """Hold the job's lease while the block runs, renewed on a thread every ALIVE_TTL_S / 3
        (a compile child blocks the worker's own); yields False, holding nothing, if another
        live run has it. A failed renewal (the broker full or away) is retried at the next
        beat; waiters take the job over only after ALIVE_TTL_S without one (then the lease is
        someone else's, and this run's result is stored all the same: completion is
        idempotent)."""
        try:
            token = self.take_lease(job, holder)
        except redis.RedisError:  # unknown: run it (at worst twice), as before leases
            token = f"{holder}/{uuid.uuid4().hex}"
        if token is None:
            yield False
            return
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(ALIVE_TTL_S / 3):
                with contextlib.suppress(redis.RedisError):
                    self._renew_lease(keys=[keys.alive(job)], args=[token, int(ALIVE_TTL_S * 1000)])

        thread = threading.Thread(target=beat, name=f"lease-{job[:8]}", daemon=True)
        thread.start()
        try:
            yield True
        finally:
            stop.set()
            thread.join()
            # A run that ended without an outcome (its claim given back) leaves no lease that
            # would turn the job's next run away.
            with contextlib.suppress(redis.RedisError):
                self._drop_lease(keys=[keys.alive(job)], args=[token])

    def take_over(self, job: str, seen: JobState) -> bool:
        """Drop the claim of a job its caller found stranded in state `seen` (orphaned, or lost
        in the queue) if nothing moved since (no worker took it, beat or ended it, no other
        waiter took it over), so that the caller can claim and queue it afresh; True if this
        caller dropped it."""
        if not (seen.orphaned or seen.queued):
            return False
        dropped = self._take_over(
            keys=[
                keys.claim(job),
                keys.stage(job),
                keys.alive(job),
                keys.outcome(job),
                keys.events(job),
            ],
            args=[seen.claim, seen.stage, pb.Progress.QUEUED],
        )
        return bool(dropped)

    def finish(
        self,
        job: str,
        outcome: pb.JobOutcome,
        remember_s: float = 0,
        uncached: tuple[pb.EntryMeta, bytes] | None = None,
    ) -> None:
        """End the job: record its outcome (with the artifact itself when the cache could not
        keep it), remember a lasting failure for `remember_s`, drop the claim (whoever holds
        it: a claimant that has not posted yet then finds it gone, see `post`) and payload,
        and notify the waiters, all in one transaction."""
        kept = pb.JobOutcome(
            kind=outcome.kind,
            digest=outcome.digest,
            error=outcome.error[-ERROR_CHARS:],
            timings=outcome.timings,
        )
        pipe = self.redis.pipeline()
        if uncached is not None:
            meta, data = uncached
            pipe.hset(
                keys.uncached(job),
                mapping={"meta": meta.SerializeToString(), "blob": self.codec.encode(data)},
            )
            pipe.expire(keys.uncached(job), UNCACHED_TTL_S)
        pipe.set(keys.outcome(job), kept.SerializeToString(), ex=OUTCOME_TTL_S)
        if kept.kind == pb.JobOutcome.FAILED and remember_s > 0:
            pipe.set(keys.failed(job), kept.error, ex=max(1, int(remember_s)))
        pipe.delete(
            keys.job(job), keys.stage(job), keys.claim(job), keys.waiters(job), keys.alive(job)
        )
        pipe.publish(keys.events(job), b"outcome")
        pipe.execute()
