"""The job board, on the broker's Redis: single-flight claims, queued payloads, each job's
stage and outcome, the failure memory, and a per-job notification channel.

A worker publishes on keys.events(job) whenever it changes the job's stage or writes its
outcome; a waiter subscribes first (`watch`) and reads the state second, so it misses
nothing and sleeps until something happens. The outcome is written, the claim dropped and
the notification published in one transaction: a waiter that sees the claim gone also sees
the outcome.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
ERROR_CHARS = 4000


@dataclasses.dataclass(frozen=True)
class JobState:
    """One read of a job: whether someone compiles it, its stage, how it ended (if it did)."""

    claimed: bool
    stage: pb.Progress.Stage.ValueType
    outcome: pb.JobOutcome | None


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

    # ---- single flight -----------------------------------------------------------------
    def claim(self, job: str, ttl_s: int) -> str | None:
        """Claim a compile job; a token if this caller won, None if another holds it."""
        token = uuid.uuid4().hex
        return token if self.redis.set(keys.claim(job), token, nx=True, ex=ttl_s) else None

    def release(self, job: str) -> None:
        self.redis.delete(keys.claim(job))

    def post(self, job: str, payload: bytes) -> None:
        """Gateway: the payload a worker will compile; the job starts queued, afresh."""
        pipe = self.redis.pipeline()
        pipe.set(keys.job(job), payload, ex=JOB_TTL_S)
        pipe.set(keys.stage(job), pb.Progress.QUEUED, ex=STAGE_TTL_S)
        pipe.delete(keys.outcome(job), keys.uncached(job))
        pipe.execute()

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
        pipe.exists(keys.claim(job))
        pipe.get(keys.stage(job))
        pipe.get(keys.outcome(job))
        claimed, stage, outcome = pipe.execute()
        return JobState(
            claimed=bool(claimed),
            stage=pb.Progress.Stage.ValueType(int(stage)) if stage else pb.Progress.QUEUED,
            outcome=pb.JobOutcome.FromString(outcome) if outcome else None,
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
        """The entry and verified bytes a job produced while the cache was full, if any."""
        meta, stored = self.redis.hmget(keys.uncached(job), ["meta", "blob"])
        if meta is None or stored is None:
            return None
        entry = pb.EntryMeta.FromString(meta)
        if entry.digest != digest:
            return None
        data = self.codec.decode(stored, entry.digest, entry.size)
        return None if data is None else (entry, data)

    # ---- what workers write ------------------------------------------------------------
    def set_stage(self, job: str, stage: pb.Progress.Stage.ValueType) -> None:
        pipe = self.redis.pipeline()
        pipe.set(keys.stage(job), stage, ex=STAGE_TTL_S)
        pipe.publish(keys.events(job), b"stage")
        pipe.execute()

    def finish(
        self,
        job: str,
        outcome: pb.JobOutcome,
        remember_s: float = 0,
        uncached: tuple[pb.EntryMeta, bytes] | None = None,
    ) -> None:
        """End the job: record its outcome (with the artifact itself when the cache could not
        keep it), remember a lasting failure for `remember_s`, drop the claim and payload, and
        notify the waiters, all in one transaction."""
        kept = pb.JobOutcome(
            kind=outcome.kind, digest=outcome.digest, error=outcome.error[-ERROR_CHARS:]
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
        pipe.delete(keys.job(job), keys.stage(job), keys.claim(job))
        pipe.publish(keys.events(job), b"outcome")
        pipe.execute()
