"""Hits counted in the gateway's memory and written to the cache's Redis together, once per
FLUSH_S: an entry's usage (hits, last hit, its place in the LRU order) and the farm's and its
pool's counters (hits, bytes served, compile seconds saved).

Written per hit, this bookkeeping was a Redis round trip of its own on every hit, about a
fifth of the gateway's CPU per hit. It is bookkeeping only: nothing is served from it, and
what a gateway that dies takes with it is under FLUSH_S of counts. This gateway's Admin RPCs
flush before they read; another gateway's hits show up within FLUSH_S."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
import weakref

import redis

from torchfarm.cache.store import Store
from torchfarm.proto import torchfarm_pb2 as pb

log = logging.getLogger("torchfarm.gateway")
FLUSH_S = 1.0


@dataclasses.dataclass
class _Usage:
    hits: int = 0
    last_hit: float = 0.0


@dataclasses.dataclass
class _PoolCounts:
    hits: int = 0
    bytes_served: float = 0.0
    compile_seconds_saved: float = 0.0


class HitLedger:
    """Hits not written yet; a daemon thread writes them every `flush_s` (started with the
    first hit), and flush_all once more when the process exits."""

    def __init__(self, store: Store, flush_s: float = FLUSH_S):
        self.store, self.flush_s = store, flush_s
        self._usage: dict[tuple[str, str], _Usage] = {}
        self._pools: dict[str, _PoolCounts] = {}
        self._lock = threading.Lock()  # guards the two dicts
        self._flushing = threading.Lock()  # one write at a time, in the order taken
        self._thread: threading.Thread | None = None

    def add(self, key: str, entry: pb.EntryMeta) -> None:
        """Entry `entry` of `key` was served as a hit, now."""
        with self._lock:
            usage = self._usage.setdefault((key, entry.digest), _Usage())
            usage.hits += 1
            usage.last_hit = time.time()
            pool = self._pools.setdefault(entry.pool, _PoolCounts())
            pool.hits += 1
            pool.bytes_served += entry.size
            pool.compile_seconds_saved += entry.compile_seconds
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hit-ledger", daemon=True)
                self._thread.start()
                _started.add(self)

    def flush(self) -> None:
        """Write what was counted so far, in one round trip; a refusal (Redis full or
        unreachable) loses those counts with a warning, as a hit written alone did."""
        with self._flushing:
            with self._lock:
                usage, pools = self._usage, self._pools
                self._usage, self._pools = {}, {}
            if not usage and not pools:
                return
            pipe = self.store.artifacts.redis.pipeline(transaction=False)
            for (key, digest), used in usage.items():
                self.store.artifacts.record_hit(key, digest, pipe, used.hits, used.last_hit)
            for name, counts in pools.items():
                self.store.counters.count(name, pipe=pipe, **dataclasses.asdict(counts))
            try:
                pipe.execute()
            except redis.RedisError as e:
                hits = sum(u.hits for u in usage.values())
                log.warning("%d hits not counted: the cache's Redis refused them: %s", hits, e)

    def _run(self) -> None:
        while True:
            time.sleep(self.flush_s)
            self.flush()


_started: weakref.WeakSet[HitLedger] = weakref.WeakSet()  # ledgers whose thread runs


@atexit.register
def flush_all() -> None:
    """Write every ledger's hits now: at exit, and in tests before they empty the store (a
    ledger of an earlier test would otherwise write into the next one's)."""
    for ledger in list(_started):
        ledger.flush()
