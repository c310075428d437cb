"""The pool registry, on the broker's Redis: each pool's description and its workers'
readiness, kept alive by their heartbeats, so the gateway knows which targets it can serve
and whether the workers behind them can compile; and each pool's kernel cache generation,
which `torchfarm cache drop-kernels` raises and workers compare with the one their kernel
cache was kept under (workers/kernel_cache.py). It never expires: a worker away during a drop
discards its kernels when it next compiles.

A pool is one hash (keys.pool): worker id -> that worker's last heartbeat. A worker is
"starting" until its canary compile (workers/canary.py) ends, then "ready" or "failed". A
failed worker exits, so its last word is kept FAILURE_TTL_S, long enough for the gateway,
`torchfarm doctor` and whoever restarts it to read why; a live one's lasts POOL_TTL_S.
Times are the broker's clock (Redis TIME), never a worker's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

import redis
from google.protobuf.message import DecodeError

from torchfarm.cache import keys
from torchfarm.proto import torchfarm_pb2 as pb

POOL_TTL_S = 30  # a worker unheard of this long is gone
FAILURE_TTL_S = 600  # a failed canary stays reported this long after its worker exited
MAX_TUNING_BUILDS = 4096  # builds a pool remembers keeping tuning of (`add_tuning`)

State = Literal["starting", "ready", "failed"]


@dataclasses.dataclass(frozen=True)
class Readiness:
    """Where a worker stands: its canary's verdict, the error text, when the canary ended."""

    state: State = "starting"
    error: str = ""
    checked_at: float = 0.0  # Unix time, 0 while starting


@dataclasses.dataclass(frozen=True)
class WorkerEntry:
    """One worker's last heartbeat, as the registry holds it (JSON)."""

    readiness: Readiness
    seen: float  # the broker's time of the heartbeat
    pid: int = 0
    host: str = ""
    concurrency: int = 0  # compiles it runs at once
    warm_children: int = 0  # compile children it keeps warm
    # how long it had had a free compile slot at the heartbeat (-1: all busy, or not told)
    free_for_s: float = -1.0


@dataclasses.dataclass(frozen=True)
class PoolState:
    """A pool as its live workers describe it."""

    name: str
    describe: str
    target: dict
    workers: dict[str, WorkerEntry]

    @property
    def state(self) -> State:
        """ready if any worker is, else starting if any worker is, else failed."""
        states = {w.readiness.state for w in self.workers.values()}
        return "ready" if "ready" in states else "starting" if "starting" in states else "failed"

    @property
    def error(self) -> str:
        """The latest canary failure of the pool's workers ("" if none failed)."""
        failed = [w.readiness for w in self.workers.values() if w.readiness.state == "failed"]
        return max(failed, key=lambda r: r.checked_at).error if failed else ""

    def took_nothing_since(self, since: float, grace_s: float) -> bool:
        """Whether a ready worker had a free compile slot for `grace_s` between `since` (the
        broker's time) and its last heartbeat. A free worker takes a queued job within
        milliseconds, so a job queued before `since` and still untaken is not waiting its turn:
        its message was lost (a worker that died between taking it and starting it)."""
        return any(
            w.readiness.state == "ready"
            and w.free_for_s >= 0
            and min(w.free_for_s, w.seen - since) >= grace_s
            for w in self.workers.values()
        )

    def cannot_compile(self) -> str:
        """Why this pool cannot take a compile now, in one line ("" if it can, or soon will)."""
        if self.state != "failed":
            return ""
        return f"pool {self.name} cannot compile: {summary(self.error)}"


def summary(error: str, chars: int = 800) -> str:
    """An error's first and last lines (what failed, and the exception at the bottom of its
    traceback): short enough for a gRPC status or a line of `torchfarm doctor`."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    text = " ... ".join(lines[:1] + lines[-1:]) if len(lines) > 1 else "".join(lines)
    return text if len(text) <= chars else text[: chars // 2] + " ... " + text[-chars // 2 :]


class PoolRegistry:
    def __init__(self, client: redis.Redis):
        self.redis = client

    def _now(self) -> float:
        seconds, micros = self.redis.time()
        return seconds + micros / 1e6

    def register(
        self, name: str, worker: str, info: dict, readiness: Readiness, pid: int = 0, host: str = ""
    ) -> None:
        """One heartbeat of `worker` in pool `name` (`info`: the pool's target, describe)."""
        failed = readiness.state == "failed"
        entry = {
            **info,
            "readiness": dataclasses.asdict(readiness),
            "seen": self._now(),
            "pid": pid,
            "host": host,
        }
        key = keys.pool(name)
        ttl = self.redis.ttl(key)  # -2 (none) or -1 (no expiry) lose to ours
        stale = [w for w, e in self._entries(key).items() if self._stale(e, entry["seen"])]
        pipe = self.redis.pipeline()
        if stale:  # workers gone for good (each restart is a new id)
            pipe.hdel(key, *stale)
        pipe.hset(key, worker, json.dumps(entry, sort_keys=True))
        pipe.expire(key, max(ttl, FAILURE_TTL_S if failed else POOL_TTL_S))
        pipe.execute()

    def _entries(self, key: bytes | str) -> dict[str, dict]:
        return {w.decode(): json.loads(raw) for w, raw in self.redis.hgetall(key).items()}

    @staticmethod
    def _stale(entry: dict, now: float) -> bool:
        failed = entry["readiness"]["state"] == "failed"
        return now - entry["seen"] > (FAILURE_TTL_S if failed else POOL_TTL_S)

    def kernel_generation(self, pool: str) -> int:
        """The generation of `pool`'s kernel caches: 0 until it is first dropped."""
        return int(self.redis.get(keys.kernel_generation(pool)) or 0)

    def drop_kernels(self, pool: str) -> int:
        """Tell every worker of `pool` to discard its kernel cache, and forget the builds it
        kept tuning of; the new generation."""
        with self.redis.pipeline() as pipe:
            pipe.delete(keys.pool_tuning(pool))
            pipe.incr(keys.kernel_generation(pool))
            return int(pipe.execute()[-1])

    def add_tuning(self, pool: str, builds: list[pb.KernelBuild]) -> int:
        """Remember builds whose tuning `pool` kept (a worker's, or a bundle's), for every
        worker of the pool and for `cache export`, up to MAX_TUNING_BUILDS; how many were new.
        Only GEMM problems and Triton kernels: what a reader does with one is build it."""
        members = [
            b.SerializeToString(deterministic=True)
            for b in builds
            if b.WhichOneof("source") in ("gemm", "triton")
        ]
        key = keys.pool_tuning(pool)
        if not members or self.redis.scard(key) >= MAX_TUNING_BUILDS:
            return 0
        return int(self.redis.sadd(key, *members))

    def tuning_count(self, pool: str) -> int:
        return int(self.redis.scard(keys.pool_tuning(pool)))

    def tuning(self, pool: str) -> list[pb.KernelBuild]:
        """The builds `pool` kept tuning of (what no longer parses is left out)."""
        return _builds(self.redis.smembers(keys.pool_tuning(pool)))

    def tuning_by_pool(self) -> dict[str, list[pb.KernelBuild]]:
        """Every pool's `tuning`."""
        found = {}
        for key in self.redis.scan_iter(keys.POOL_TUNING_PATTERN, count=100):
            found[key.decode().split(":", 2)[2]] = _builds(self.redis.smembers(key))
        return found

    def live(self) -> dict[str, PoolState]:
        """Every pool with a worker heard from in the last POOL_TTL_S, or whose worker's canary
        failed in the last FAILURE_TTL_S."""
        now, pools = self._now(), {}
        for key in self.redis.scan_iter(keys.POOL_PATTERN, count=100):
            name = key.decode().split(":", 2)[2]
            workers, describe, target = {}, "", {}
            for worker, data in self._entries(key).items():
                if not self._stale(data, now):
                    workers[worker] = WorkerEntry(
                        Readiness(**data["readiness"]),
                        data["seen"],
                        data["pid"],
                        data["host"],
                        data.get("concurrency", 0),
                        data.get("warm_children", 0),
                        data.get("free_for_s", -1.0),
                    )
                    describe, target = data.get("describe", ""), data.get("target", {})
            if workers:
                pools[name] = PoolState(name, describe, target, workers)
        return pools


def _builds(members) -> list[pb.KernelBuild]:
    builds = []
    for member in members:
        try:
            builds.append(pb.KernelBuild.FromString(member))  # protobuf parse: no code runs
        except DecodeError:
            continue
    return builds
