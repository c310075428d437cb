"""The cache in Redis: content-addressed artifact blobs and an index of entries per key.

Blobs are zstd-compressed and verified (size and sha256) on every read; a bad or missing
blob is dropped with the index entries that point to it and reads as a miss. Only workers
call the write methods; the gateway reads, claims and queues.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid

import redis
import zstandard

from torchfarm.cache import keys

JOB_TTL_S = 3600
STATUS_TTL_S = 3600
ERROR_TTL_S = 60
POOL_TTL_S = 30


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Store:
    """Typed access to the farm's Redis keyspace."""

    def __init__(self, client: redis.Redis):
        self.redis = client

    @classmethod
    def from_url(cls, url: str) -> Store:
        return cls(redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5,
                                        health_check_interval=30, retry_on_timeout=True))

    # ---- entries and blobs -------------------------------------------------------------
    def entries(self, key: str) -> list[dict]:
        """Entries for a key, newest first: {"digest", "size", "guards_expr", ...}."""
        raw = self.redis.hgetall(keys.index(key))
        found = [dict(json.loads(v), digest=d.decode()) for d, v in raw.items()]
        return sorted(found, key=lambda e: e.get("created", 0), reverse=True)

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
            self.drop(key, digest)
            return None
        return data

    def drop(self, key: str, digest: str) -> None:
        pipe = self.redis.pipeline()
        pipe.hdel(keys.index(key), digest)
        pipe.delete(keys.blob(digest))
        pipe.execute()

    def put_artifact(self, key: str, data: bytes, meta: dict) -> str:
        """Worker only: store the blob and the index entry that names it, then end the job
        (in one transaction, so waiters never see the claim gone without the entry)."""
        digest = digest_of(data)
        entry = dict(meta, size=len(data), created=time.time())
        pipe = self.redis.pipeline()
        pipe.set(keys.blob(digest), zstandard.ZstdCompressor(level=3).compress(data))
        pipe.hset(keys.index(key), digest, json.dumps(entry, sort_keys=True))
        pipe.delete(keys.job(key), keys.status(key), keys.claim(key))
        pipe.execute()
        return digest

    # ---- single flight and jobs --------------------------------------------------------
    def claim(self, key: str, ttl_s: int) -> str | None:
        """Claim the compile of `key`; a token if this caller won, None if another holds it."""
        token = uuid.uuid4().hex
        return token if self.redis.set(keys.claim(key), token, nx=True, ex=ttl_s) else None

    def claimed(self, key: str) -> bool:
        return bool(self.redis.exists(keys.claim(key)))

    def release(self, key: str) -> None:
        self.redis.delete(keys.claim(key))

    def put_job(self, key: str, payload: bytes) -> None:
        pipe = self.redis.pipeline()
        pipe.set(keys.job(key), payload, ex=JOB_TTL_S)
        pipe.set(keys.status(key), "queued", ex=STATUS_TTL_S)
        pipe.delete(keys.error(key))
        pipe.execute()

    def job_payload(self, key: str) -> bytes | None:
        return self.redis.get(keys.job(key))

    def finish_job(self, key: str, error: str | None = None) -> None:
        """Worker: the compile of `key` ended; waiters see an entry or this error."""
        pipe = self.redis.pipeline()
        if error is not None:
            pipe.set(keys.error(key), error[-4000:], ex=ERROR_TTL_S)
        pipe.delete(keys.job(key), keys.status(key), keys.claim(key))
        pipe.execute()

    def set_status(self, key: str, status: str) -> None:
        self.redis.set(keys.status(key), status, ex=STATUS_TTL_S)

    def status(self, key: str) -> str:
        value = self.redis.get(keys.status(key))
        return value.decode() if value else ""

    def error(self, key: str) -> str | None:
        value = self.redis.get(keys.error(key))
        return value.decode() if value else None

    # ---- pools and stats ---------------------------------------------------------------
    def register_pool(self, name: str, info: dict) -> None:
        self.redis.set(keys.pool(name), json.dumps(info, sort_keys=True), ex=POOL_TTL_S)

    def pools(self) -> dict[str, dict]:
        names = list(self.redis.scan_iter(keys.POOL_PATTERN, count=100))
        values = self.redis.mget(names) if names else []
        return {n.decode().split(":", 2)[2]: json.loads(v) for n, v in zip(names, values) if v}

    def count(self, **increments: float) -> None:
        pipe = self.redis.pipeline()
        for name, amount in increments.items():
            pipe.hincrbyfloat(keys.STATS, name, amount)
        pipe.execute()

    def stats(self) -> dict[str, float]:
        return {k.decode(): float(v) for k, v in self.redis.hgetall(keys.STATS).items()}
