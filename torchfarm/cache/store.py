"""The cache in Redis: content-addressed artifact blobs and an index of entries per key.

Blobs are zstd-compressed and verified (size and sha256) on every read; a bad or missing
blob is dropped with the index entries that point to it and reads as a miss. Only workers
call the write methods; the gateway reads, claims and queues.

Job state (claims, payloads, statuses, outcomes, pools) lives on the broker's Redis (by
default another database of the same server). When the cache's Redis is at its memory
limit, a worker hands its artifact to the waiting gateways through the job state instead
("uncached"), and bookkeeping writes (hit counts, counters) are skipped with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
import uuid

import redis
import zstandard

from torchfarm.cache import keys
from torchfarm.settings import broker_url

log = logging.getLogger("torchfarm.cache")

JOB_TTL_S = 3600
STATUS_TTL_S = 3600
ERROR_TTL_S = 60
DONE_TTL_S = 3600
UNCACHED_TTL_S = 600  # long enough for every merged waiter to read it
POOL_TTL_S = 30


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _connect(url: str) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        socket_timeout=10,
        socket_connect_timeout=5,
        health_check_interval=30,
        retry_on_timeout=True,
    )


def _unless_full(method):
    """Bookkeeping that a full cache Redis skips (with a warning) instead of failing."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except redis.exceptions.OutOfMemoryError:
            log.warning("the cache's Redis is at its memory limit: %s skipped", method.__name__)

    return wrapper


class Store:
    """Typed access to the farm's Redis keyspace: `redis` holds the cache, `jobs` the job
    state (the same client when one server holds both)."""

    def __init__(self, client: redis.Redis, jobs: redis.Redis | None = None):
        self.redis = client
        self.jobs = jobs if jobs is not None else client

    @classmethod
    def from_url(cls, url: str, broker: str = "") -> Store:
        """The cache at `url`; job state on the broker's Redis (see settings.broker_url)."""
        return cls(_connect(url), _connect(broker_url(url, broker)))

    # ---- entries and blobs -------------------------------------------------------------
    def keys(self) -> list[tuple[str, float]]:
        """Every cached key with the time of its last use, least recently used first."""
        return [(k.decode(), t) for k, t in self.redis.zrange(keys.RECENT, 0, -1, withscores=True)]

    def entries(self, key: str) -> list[dict]:
        """Entries for a key, newest first: {"digest", "size", "guards_expr", "hits", ...}."""
        raw = self.redis.hgetall(keys.index(key))
        usage = {k.decode(): float(v) for k, v in self.redis.hgetall(keys.usage(key)).items()}
        found = [
            dict(
                json.loads(v),
                digest=d.decode(),
                hits=int(usage.get(f"{d.decode()}:hits", 0)),
                last_hit=usage.get(f"{d.decode()}:last_hit", 0.0),
            )
            for d, v in raw.items()
        ]
        return sorted(found, key=lambda e: e.get("created", 0), reverse=True)

    def rows(self) -> list[dict]:
        """Every entry of every key, with its key and last use (the cache CLI's rows)."""
        return [
            dict(entry, key=key, last_used=last_used)
            for key, last_used in self.keys()
            for entry in self.entries(key)
        ]

    def summary(self) -> dict:
        """Totals (entries, bytes, hits, misses, hit rate, compile seconds saved) and per pool:
        `torchfarm cache stats` and the Admin.Stats RPC."""
        counters, rows = self.stats(), self.rows()
        per_pool: dict[str, dict] = {
            name: dict(values, entries=0, bytes=0) for name, values in self.pool_stats().items()
        }
        for r in rows:
            pool = per_pool.setdefault(r.get("pool", ""), {"entries": 0, "bytes": 0})
            pool["entries"] += 1
            pool["bytes"] += r.get("stored_bytes", 0)
        hits, misses, merges = (int(counters.get(k, 0)) for k in ("hits", "misses", "merges"))
        requests = hits + misses + merges
        return {
            "entries": len(rows),
            "bytes": sum(r.get("stored_bytes", 0) for r in rows),
            "artifact_bytes": sum(r.get("size", 0) for r in rows),
            "hits": hits,
            "misses": misses,
            "merges": merges,
            "hit_rate": round(hits / requests, 4) if requests else 0.0,
            "compiles": int(counters.get("compiles", 0)),
            "compile_failures": int(counters.get("compile_failures", 0)),
            "compile_seconds": round(counters.get("compile_seconds", 0.0), 3),
            "compile_seconds_saved": round(counters.get("compile_seconds_saved", 0.0), 3),
            "bytes_served": int(counters.get("bytes_served", 0)),
            "pools": per_pool,
        }

    def read_blob(self, key: str, entry: dict) -> bytes | None:
        """The artifact bytes of an entry, verified; None (and the entry dropped) if bad."""
        digest = entry["digest"]
        stored = self.redis.get(keys.blob(digest))
        data = None
        if stored is not None:
            try:
                data = zstandard.ZstdDecompressor().decompress(stored)
            except zstandard.ZstdError:
                data = None
        if data is None or len(data) != entry.get("size") or digest_of(data) != digest:
            self.drop(key, [digest])
            return None
        return data

    def drop(self, key: str, digests: list[str] | None = None) -> int:
        """Remove entries of `key` (all if `digests` is None) with their blobs, in one
        transaction; the number removed. The key leaves the LRU order once it has none."""

        def remove(pipe: redis.client.Pipeline) -> int:
            raw = pipe.hgetall(keys.index(key))
            chosen = {
                d.decode(): json.loads(v)
                for d, v in raw.items()
                if digests is None or d.decode() in digests
            }
            pipe.multi()
            if chosen:
                pipe.hdel(keys.index(key), *chosen)
                pipe.hdel(
                    keys.usage(key), *(f"{d}:{f}" for d in chosen for f in ("hits", "last_hit"))
                )
                pipe.delete(*(keys.blob(d) for d in chosen))
                pipe.hincrbyfloat(
                    keys.STATS,
                    "stored_bytes",
                    -sum(e.get("stored_bytes", 0) for e in chosen.values()),
                )
                pipe.hincrbyfloat(keys.STATS, "entries", -len(chosen))
            if len(chosen) == len(raw):
                pipe.zrem(keys.RECENT, key)
                pipe.delete(keys.index(key), keys.usage(key))
            return len(chosen)

        return self.redis.transaction(remove, keys.index(key), value_from_callable=True)

    def _put_entry(self, pipe, key: str, data: bytes, meta: dict) -> str:
        digest = digest_of(data)
        compressed = zstandard.ZstdCompressor(level=3).compress(data)
        entry = dict(
            meta,
            size=len(data),
            stored_bytes=len(compressed),
            created=meta.get("created") or time.time(),
        )
        pipe.set(keys.blob(digest), compressed)
        pipe.hset(keys.index(key), digest, json.dumps(entry, sort_keys=True))
        pipe.zadd(keys.RECENT, {key: time.time()})
        pipe.hincrbyfloat(keys.STATS, "stored_bytes", len(compressed))
        pipe.hincrbyfloat(keys.STATS, "entries", 1)
        return digest

    def put_artifact(self, key: str, job: str, data: bytes, meta: dict) -> tuple[str, bool]:
        """Worker only: store the blob and the index entry that names it (one transaction),
        then end the job, so waiters never see the claim gone without the entry. If the
        cache's Redis is full, the artifact goes to the job's waiters only. Returns the
        digest and whether it was cached."""
        pipe = self.redis.pipeline()
        digest = self._put_entry(pipe, key, data, meta)
        cached = True
        try:
            pipe.execute()
        except redis.exceptions.OutOfMemoryError:  # MULTI/EXEC: nothing was written
            log.warning("the cache's Redis is at its memory limit: %s served uncached", key[:16])
            cached = False
        ending = self.jobs.pipeline()
        if not cached:
            entry = dict(meta, digest=digest, size=len(data))
            ending.set(
                keys.uncached(job),
                json.dumps(entry).encode()
                + b"\n"
                + zstandard.ZstdCompressor(level=3).compress(data),
                ex=UNCACHED_TTL_S,
            )
        ending.set(keys.done(job), digest, ex=DONE_TTL_S)
        ending.delete(keys.job(job), keys.status(job), keys.claim(job))
        ending.execute()
        return digest, cached

    def done(self, job: str) -> str | None:
        """The digest a finished job stored, while it is remembered."""
        value = self.jobs.get(keys.done(job))
        return value.decode() if value else None

    def uncached(self, job: str, digest: str) -> tuple[dict, bytes] | None:
        """The entry and verified bytes a job produced while the cache was full, if any."""
        stored = self.jobs.get(keys.uncached(job))
        if stored is None:
            return None
        head, _, body = stored.partition(b"\n")
        try:
            data = zstandard.ZstdDecompressor().decompress(body)
        except zstandard.ZstdError:
            return None
        return (json.loads(head), data) if digest_of(data) == digest else None

    def entry(self, key: str, digest: str) -> dict | None:
        return next((e for e in self.entries(key) if e["digest"] == digest), None)

    def import_entry(self, key: str, data: bytes, meta: dict) -> str:
        """Operator only (`torchfarm cache import`): store a verified entry from a bundle."""
        digest = digest_of(data)
        if self.entry(key, digest) is not None:
            return digest
        pipe = self.redis.pipeline()
        self._put_entry(pipe, key, data, meta)
        pipe.execute()
        return digest

    @_unless_full
    def record_hit(self, key: str, entry: dict, nbytes: int) -> None:
        """Gateway: an entry was served; it becomes the most recently used."""
        now = time.time()
        pipe = self.redis.pipeline()
        pipe.hincrby(keys.usage(key), f"{entry['digest']}:hits", 1)
        pipe.hset(keys.usage(key), f"{entry['digest']}:last_hit", now)
        pipe.zadd(keys.RECENT, {key: now}, xx=True)
        pipe.execute()
        self.count(
            entry.get("pool", ""),
            hits=1,
            bytes_served=nbytes,
            compile_seconds_saved=entry.get("compile_seconds", 0.0),
        )

    def evict(self, max_bytes: int, ttl_s: float = 0, now: float | None = None) -> list[str]:
        """Drop keys unused for `ttl_s` (0: no TTL), then least recently used keys until the
        stored bytes fit `max_bytes` (0: no budget). The keys dropped, oldest first."""
        now = time.time() if now is None else now
        dropped = []
        if ttl_s > 0:
            for key in self.redis.zrangebyscore(keys.RECENT, "-inf", now - ttl_s):
                self.drop(key.decode())
                dropped.append(key.decode())
        while max_bytes > 0 and self.stats().get("stored_bytes", 0) > max_bytes:
            oldest = self.redis.zrange(keys.RECENT, 0, 0)
            if not oldest:
                break
            self.drop(oldest[0].decode())
            dropped.append(oldest[0].decode())
        return dropped

    # ---- single flight and jobs --------------------------------------------------------
    def claim(self, job: str, ttl_s: int) -> str | None:
        """Claim a compile job; a token if this caller won, None if another holds it."""
        token = uuid.uuid4().hex
        return token if self.jobs.set(keys.claim(job), token, nx=True, ex=ttl_s) else None

    def claimed(self, job: str) -> bool:
        return bool(self.jobs.exists(keys.claim(job)))

    def release(self, job: str) -> None:
        self.jobs.delete(keys.claim(job))

    def put_job(self, job: str, payload: bytes) -> None:
        pipe = self.jobs.pipeline()
        pipe.set(keys.job(job), payload, ex=JOB_TTL_S)
        pipe.set(keys.status(job), "queued", ex=STATUS_TTL_S)
        pipe.delete(keys.error(job), keys.done(job))
        pipe.execute()

    def job_payload(self, job: str) -> bytes | None:
        return self.jobs.get(keys.job(job))

    def finish_job(self, job: str, error: str | None = None, remember_s: float = 0) -> None:
        """Worker: the job ended without storing an entry; waiters see this error, and for
        `remember_s` new requests of the job get it without a compile (see `failure`)."""
        pipe = self.jobs.pipeline()
        if error is not None:
            pipe.set(keys.error(job), error[-4000:], ex=ERROR_TTL_S)
            if remember_s > 0:
                pipe.set(keys.failed(job), error[-4000:], ex=max(1, int(remember_s)))
        pipe.delete(keys.job(job), keys.status(job), keys.claim(job))
        pipe.execute()

    def set_status(self, job: str, status: str) -> None:
        self.jobs.set(keys.status(job), status, ex=STATUS_TTL_S)

    def status(self, job: str) -> str:
        value = self.jobs.get(keys.status(job))
        return value.decode() if value else ""

    def error(self, job: str) -> str | None:
        value = self.jobs.get(keys.error(job))
        return value.decode() if value else None

    def failure(self, job: str) -> str | None:
        """The error of a recent compile of this job that failed by itself (not a timeout or a
        killed child), which another compile would meet again."""
        value = self.jobs.get(keys.failed(job))
        return value.decode() if value else None

    # ---- pools and stats ---------------------------------------------------------------
    def register_pool(self, name: str, info: dict) -> None:
        self.jobs.set(keys.pool(name), json.dumps(info, sort_keys=True), ex=POOL_TTL_S)

    def pools(self) -> dict[str, dict]:
        names = list(self.jobs.scan_iter(keys.POOL_PATTERN, count=100))
        values = self.jobs.mget(names) if names else []
        return {n.decode().split(":", 2)[2]: json.loads(v) for n, v in zip(names, values) if v}

    @_unless_full
    def count(self, pool: str = "", **increments: float) -> None:
        """Add to the farm-wide counters, and to `pool`'s when given."""
        pipe = self.redis.pipeline()
        for name, amount in increments.items():
            pipe.hincrbyfloat(keys.STATS, name, amount)
            if pool:
                pipe.hincrbyfloat(keys.pool_stats(pool), name, amount)
        pipe.execute()

    def stats(self) -> dict[str, float]:
        return {k.decode(): float(v) for k, v in self.redis.hgetall(keys.STATS).items()}

    def pool_stats(self) -> dict[str, dict[str, float]]:
        found = {}
        for name in self.redis.scan_iter(keys.POOL_STATS_PATTERN, count=100):
            found[name.decode().split(":", 2)[2]] = {
                k.decode(): float(v) for k, v in self.redis.hgetall(name).items()
            }
        return found
