"""Which keys hold entries one tenant made of one program (graph structure,
compiler/structure.py), so that tenant's misses can be compared with its nearest entry.
Written by workers only, beside the entry they store, under the tenant whose request caused
the compile; bounded per structure and expiring, since it is only ever a hint: the entries
themselves are read (and filtered by tenant) from the index.

Per tenant because the structure comes from the compile child, which runs the tenant's code:
a hostile child can report any structure, and so join any group it names, but only among its
own tenant's (issue 27: it could join another tenant's and learn of its entries)."""

from __future__ import annotations

import logging
import time

from torchfarm.cache import keys
from torchfarm.cache.blobs import CacheClient, OutOfMemoryError

log = logging.getLogger("torchfarm.cache")

MAX_KEYS = 32  # the newest keys kept per structure
TTL_S = 30 * 24 * 3600


class Structures:
    def __init__(self, client: CacheClient):
        self.redis = client

    def add(self, tenant: str, structure: str, key: str) -> None:
        """`key` (as stored: a private entry's derived key) has an entry of `structure` that a
        request of `tenant` made."""
        name = keys.structure(tenant, structure)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(name, {key: time.time()})
        pipe.zremrangebyrank(name, 0, -MAX_KEYS - 1)
        pipe.expire(name, TTL_S)
        try:
            pipe.execute()
        except OutOfMemoryError:  # only a hint for explaining misses: the entry is stored
            log.warning("the cache's Redis is at its memory limit: structure of %s not kept", key)

    def keys(self, tenant: str, structure: str) -> list[str]:
        """The keys with entries of `structure` that `tenant` made, newest first (some may
        have none any more)."""
        return [k.decode() for k in self.redis.zrevrange(keys.structure(tenant, structure), 0, -1)]
