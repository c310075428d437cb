"""The composition root of the farm's state: the artifact cache's index and the counters on
the cache's Redis, its blobs where TORCHFARM_BLOB_URL says (cache/blobs.py); the job board
and the pool registry on the broker's Redis (by default another database of the same
server), so a full cache never stops a compile from being queued and answered. Built once
per process with `Store.from_url`.

Only workers write entries (and operators, through `torchfarm cache import`); the gateway
reads entries, claims and posts jobs, and counts.
"""

from __future__ import annotations

import dataclasses

import redis
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from torchfarm.cache.artifacts import ArtifactCache
from torchfarm.cache.blobs import BlobBackend, CacheClient, open_blobs
from torchfarm.cache.counters import Counters
from torchfarm.cache.jobs import JobBoard
from torchfarm.cache.pools import PoolRegistry
from torchfarm.cache.programs import Programs
from torchfarm.cache.structures import Structures
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import broker_url, is_cluster


def connect(url: str) -> redis.Redis:
    """A client of one Redis (or Valkey) server."""
    return redis.Redis.from_url(
        url,
        socket_timeout=10,
        socket_connect_timeout=5,
        health_check_interval=30,
        retry_on_timeout=True,
    )


def connect_cache(url: str) -> CacheClient:
    """A client of the cache's Redis: for a cluster (redis+cluster://, settings.is_cluster)
    one that learns the slots from the node named and follows them (reading the cluster at
    once, where a plain client connects on its first command)."""
    if not is_cluster(url):
        return connect(url)
    return redis.RedisCluster.from_url(
        url.replace("+cluster", "", 1),
        socket_timeout=10,
        socket_connect_timeout=5,
        retry_on_timeout=True,
    )


@dataclasses.dataclass(frozen=True)
class Store:
    artifacts: ArtifactCache
    counters: Counters
    jobs: JobBoard
    pools: PoolRegistry
    structures: Structures  # explaining misses: the keys of each program (workers write)
    programs: Programs  # prefetch: what each tenant's program was served (the gateway writes)

    @classmethod
    def from_url(cls, redis_url: str, broker: str = "", blob_url: str = "redis") -> Store:
        """`blob_url`: where blobs live (TORCHFARM_BLOB_URL, cache/blobs.py)."""
        cache = connect_cache(redis_url)
        return cls.from_clients(
            cache, connect(broker_url(redis_url, broker)), open_blobs(blob_url, cache)
        )

    @classmethod
    def from_clients(
        cls, cache: CacheClient, jobs: redis.Redis | None = None, blobs: BlobBackend | None = None
    ) -> Store:
        """One client for both servers unless `jobs` is given (tests with one database);
        blobs in the cache's Redis unless `blobs` is given."""
        if jobs is None:
            if not isinstance(cache, redis.Redis):
                raise ValueError("a Redis Cluster holds the cache only: give the broker's server")
            jobs = cache
        counters = Counters(cache)
        return cls(
            ArtifactCache(cache, blobs, counters=counters),
            counters,
            JobBoard(jobs),
            PoolRegistry(jobs),
            Structures(cache),
            Programs(cache),
        )

    def rows(self) -> list[dict]:
        """Every entry of every key, with its key and last use (without its details)."""
        return [
            dict(
                entry_dict(entry),
                key=key,
                last_used=last_used,
            )
            for key, last_used in self.artifacts.keys()
            for entry in self.artifacts.entries(key)
        ]

    def summary(self) -> dict:
        """Totals (entries, bytes, hits, misses, hit rate, compile seconds saved) and per pool:
        `torchfarm cache stats` and the Admin.Stats RPC."""
        counters, rows = self.counters.farm(), self.rows()
        per_pool: dict[str, dict] = {
            name: dict(values, entries=0, bytes=0)
            for name, values in self.counters.per_pool().items()
        }
        for r in rows:
            pool = per_pool.setdefault(r["pool"], {"entries": 0, "bytes": 0})
            pool["entries"] += 1
            pool["bytes"] += r["stored_bytes"]
        hits, misses, merges = (int(counters.get(k, 0)) for k in ("hits", "misses", "merges"))
        requests = hits + misses + merges
        return {
            "entries": len(rows),
            "bytes": sum(r["stored_bytes"] for r in rows),
            "artifact_bytes": sum(r["size"] for r in rows),
            "hits": hits,
            "misses": misses,
            "merges": merges,
            "hit_rate": round(hits / requests, 4) if requests else 0.0,
            "compiles": int(counters.get("compiles", 0)),
            "compile_failures": int(counters.get("compile_failures", 0)),
            "compile_seconds": round(counters.get("compile_seconds", 0.0), 3),
            "compile_seconds_saved": round(counters.get("compile_seconds_saved", 0.0), 3),
            "bytes_served": int(counters.get("bytes_served", 0)),
            # index entries naming no blob of theirs (planted in Redis): dropped as read
            "bad_entries": int(counters.get("bad_entries", 0)),
            "pools": per_pool,
        }


_INT64 = (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64)


def entry_dict(entry: pb.EntryMeta) -> dict:
    """An entry as the cache CLI prints it (`ls/show --json`): every field by its proto name,
    defaults included, 64-bit integers as numbers (protobuf's JSON writes them as strings)."""
    fields = json_format.MessageToDict(
        entry, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers(entry.DESCRIPTOR, fields)


def _numbers(descriptor, fields: dict) -> dict:
    for field in descriptor.fields:
        value = fields.get(field.name)
        if value is None:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.type in _INT64:
                fields[field.name] = {k: int(v) for k, v in value.items()}
        elif field.message_type is not None:
            items = value if isinstance(value, list) else [value]
            for item in items:
                _numbers(field.message_type, item)
        elif field.type in _INT64:
            fields[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
    return fields


def entry_from_dict(fields: dict) -> pb.EntryMeta:
    """The inverse of entry_dict (bundles carry entries as that JSON)."""
    return json_format.ParseDict(fields, pb.EntryMeta(), ignore_unknown_fields=True)
