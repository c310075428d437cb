"""Which keys hold entries of one program (graph structure, compiler/structure.py), so a miss
can be compared with its nearest entry. Written by workers only, beside the entry they store;
bounded per structure and expiring, since it is only ever a hint: the entries themselves are
read (and filtered by tenant) from the index."""

from __future__ import annotations

import logging
import time

import redis

from torchfarm.cache import keys
from torchfarm.cache.artifacts import OutOfMemoryError

log = logging.getLogger("torchfarm.cache")

MAX_KEYS = 32  # the newest keys kept per structure
TTL_S = 30 * 24 * 3600


class Structures:
    def __init__(self, client: redis.Redis):
        self.redis = client

    def add(self, structure: str, key: str) -> None:
        """`key` (as stored: a private entry's derived key) has an entry of `structure`."""
        name = keys.structure(structure)
        pipe = self.redis.pipeline()
        pipe.zadd(name, {key: time.time()})
        pipe.zremrangebyrank(name, 0, -MAX_KEYS - 1)
        pipe.expire(name, TTL_S)
        try:
            pipe.execute()
        except OutOfMemoryError:  # only a hint for explaining misses: the entry is stored
            log.warning("the cache's Redis is at its memory limit: structure of %s not kept", key)

    def keys(self, structure: str) -> list[str]:
        """The keys with entries of `structure`, newest first (some may have none any more)."""
        return [k.decode() for k in self.redis.zrevrange(keys.structure(structure), 0, -1)]
