"""Farm-wide and per-pool counters (hits, misses, merges, compiles, seconds, bytes) in the
cache's Redis. Bookkeeping only: a full Redis skips them with a warning instead of failing
the request."""

from __future__ import annotations

import logging

from torchfarm.cache import keys
from torchfarm.cache.blobs import CacheClient, CachePipeline, OutOfMemoryError

log = logging.getLogger("torchfarm.cache")


class Counters:
    def __init__(self, client: CacheClient):
        self.redis = client

    def count(
        self, pool: str = "", *, pipe: CachePipeline | None = None, **increments: float
    ) -> None:
        """Add to the farm-wide counters, and to `pool`'s when given; into `pipe` (which the
        caller executes, with other bookkeeping: one round trip) if given."""
        own = pipe is None
        pipe = self.redis.pipeline(transaction=False) if pipe is None else pipe
        for name, amount in increments.items():
            pipe.hincrbyfloat(keys.STATS, name, amount)
            if pool:
                pipe.hincrbyfloat(keys.pool_stats(pool), name, amount)
        if not own:
            return
        try:
            pipe.execute()
        except OutOfMemoryError:
            log.warning("the cache's Redis is at its memory limit: counters not updated")

    def farm(self) -> dict[str, float]:
        return {k.decode(): float(v) for k, v in self.redis.hgetall(keys.STATS).items()}

    def per_pool(self) -> dict[str, dict[str, float]]:
        found = {}
        for name in self.redis.scan_iter(keys.POOL_STATS_PATTERN, count=100):
            found[name.decode().split(":", 2)[2]] = {
                k.decode(): float(v) for k, v in self.redis.hgetall(name).items()
            }
        return found
