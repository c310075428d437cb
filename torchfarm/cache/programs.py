"""What a tenant's program was served last time, for prefetch (issue 19): per (tenant, head,
the public key of the program's first graph) the key and entry served at each position.

The gateway records what it served itself (never a digest a client names), per tenant, so a
manifest only ever lists entries that tenant was given; it is bounded (MAX_POSITIONS) and
expires (TTL_S), refreshed by each run of the program."""

from __future__ import annotations

import logging

from google.protobuf.message import DecodeError

from torchfarm.cache import keys
from torchfarm.cache.blobs import CacheClient, OutOfMemoryError
from torchfarm.proto import torchfarm_pb2 as pb

log = logging.getLogger("torchfarm.cache")
MAX_POSITIONS = 256  # graphs remembered per program; later ones are not prefetched
TTL_S = 7 * 24 * 3600


class Programs:
    def __init__(self, client: CacheClient):
        self.redis = client

    def record(self, tenant: str, head: str, position: int, key: str, digest: str) -> None:
        """Graph `position` of the program `head` was served as (public) `key`, entry `digest`."""
        if not 0 <= position < MAX_POSITIONS:
            return
        name = keys.program(tenant, head)
        entry = pb.ManifestEntry(key=key, digest=digest, position=position)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(name, str(position), entry.SerializeToString())
        pipe.expire(name, TTL_S)
        try:
            pipe.execute()
        except OutOfMemoryError:  # a hint for prefetch: a full cache serves and compiles anyway
            log.warning("the cache's Redis is at its memory limit: program %s not recorded", head)

    def entries(self, tenant: str, head: str) -> list[pb.ManifestEntry]:
        """The graphs recorded after the head (position > 0), in order."""
        found = []
        for value in self.redis.hgetall(keys.program(tenant, head)).values():
            try:
                entry = pb.ManifestEntry.FromString(value)
            except DecodeError:
                continue
            if entry.position > 0:
                found.append(entry)
        return sorted(found, key=lambda e: e.position)
