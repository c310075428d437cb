"""The artifact cache: index entries (what is stored), a codec (how bytes are encoded and
verified) and a blob backend (where the bytes live: cache/blobs.py, the cache's Redis, a
directory or an S3-compatible store), kept apart as Inductor's remote_cache.py keeps its
backends and serdes.

Blobs are verified (size and sha256) on every read; a bad or missing blob is dropped with
the index entries that point to it and reads as a miss. A process that serves the same blobs
again and again (the gateway) keeps the ones it verified (`VerifiedBlobs`): a blob read back
byte-equal to one verified before is good without decoding it again. The index lives in the
cache's Redis: per key a hash digest -> EntryMeta, a usage hash (hits, last hit) and the LRU
order.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Literal

import zstandard
from google.protobuf.message import DecodeError

from torchfarm.cache import keys
from torchfarm.cache.blobs import (
    BlobBackend,
    CacheClient,
    CachePipeline,
    OutOfMemoryError,
    RedisBlobs,
)
from torchfarm.cache.counters import Counters
from torchfarm.errors import CacheFull, WrongBlobStore
from torchfarm.proto import torchfarm_pb2 as pb

log = logging.getLogger("torchfarm.cache")


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Codec:
    """zstd on the way in; decompression, size and sha256 checked on the way out.

    Decoding goes chunk by chunk and stops past the recorded size, so what a read holds in
    memory is one chunk, whatever the compression ratio (300 MB of zeros is 30 KB stored)."""

    CHUNK_BYTES = 1 << 20

    def encode(self, data: bytes) -> bytes:
        return zstandard.ZstdCompressor(level=3).compress(data)

    def chunks(self, stored: bytes, size: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The decoded bytes, `chunk_bytes` at a time; raises ValueError (or zstd's error)
        where they would exceed `size`."""
        reader = zstandard.ZstdDecompressor().stream_reader(stored)
        total = 0
        while piece := reader.read(chunk_bytes):
            total += len(piece)
            if total > size:
                raise ValueError(f"the blob decodes to more than its recorded {size} bytes")
            yield piece

    def verify(self, stored: bytes, digest: str, size: int) -> bool:
        """Whether `stored` decodes to the artifact `digest` of `size` (in bounded memory)."""
        hasher, total = hashlib.sha256(), 0
        try:
            for piece in self.chunks(stored, size):
                hasher.update(piece)
                total += len(piece)
        except (ValueError, zstandard.ZstdError):
            return False
        return total == size and hasher.hexdigest() == digest

    def decode(self, stored: bytes, digest: str, size: int) -> bytes | None:
        """The artifact bytes, or None if `stored` is not the artifact `digest` of `size`."""
        if not self.verify(stored, digest, size):
            return None
        return b"".join(self.chunks(stored, size))


class VerifiedBlobs:
    """Stored blobs that passed Codec.verify, by digest, least recently used dropped past
    `max_bytes` (0: remember none). Blobs are content-addressed, so a blob read back equal to
    the one remembered is the verified artifact: a byte comparison instead of decompressing
    and hashing it on every hit. For `recheck_s` after a blob was last compared with the
    store, it is served from here without reading the store at all (a hit storm reads each
    blob once per `recheck_s`, not once per hit: an S3 GET costs the gateway ~1.5 ms of
    CPU); a blob corrupted or removed in storage is then found at the next comparison, at
    most `recheck_s` later, and dropped with its entry. What is served is always the
    verified bytes. Thread-safe: the gateway serves from many threads."""

    def __init__(self, max_bytes: int = 0, recheck_s: float = 0.0):
        self.max_bytes, self.recheck_s = max_bytes, recheck_s
        self._blobs: collections.OrderedDict[str, tuple[bytes, float]] = (
            collections.OrderedDict()
        )  # digest -> (stored bytes, when last compared with the store)
        self._bytes = 0
        self._lock = threading.Lock()

    def fresh(self, digest: str) -> bytes | None:
        """The blob, if it was compared with the store less than `recheck_s` ago."""
        with self._lock:
            known = self._blobs.get(digest)
            if known is None or time.monotonic() - known[1] >= self.recheck_s:
                return None
            self._blobs.move_to_end(digest)
            return known[0]

    def holds(self, digest: str, stored: bytes) -> bool:
        """Whether `stored` (just read from the store) is the blob verified as `digest`
        before; if so, it counts as compared now."""
        with self._lock:
            known = self._blobs.get(digest)
            if known is None or known[0] != stored:
                return False
            self._blobs[digest] = (known[0], time.monotonic())
            self._blobs.move_to_end(digest)
            return True

    def remember(self, digest: str, stored: bytes) -> None:
        if len(stored) > self.max_bytes:
            return
        with self._lock:
            old = self._blobs.pop(digest, None)
            self._bytes += len(stored) - (len(old[0]) if old is not None else 0)
            self._blobs[digest] = (stored, time.monotonic())
            while self._bytes > self.max_bytes:
                _, (dropped, _) = self._blobs.popitem(last=False)
                self._bytes -= len(dropped)

    def forget(self, digest: str) -> None:
        with self._lock:
            old = self._blobs.pop(digest, None)
            if old is not None:
                self._bytes -= len(old[0])


# An entry's bulky fields, for operators only (`cache show`, `cache export`): kept beside its
# blob (`details_name`), not in Redis, so that an entry costs Redis a bounded few KB whatever
# the size of its graph. What serving, signing, eviction and explaining misses read stays.
DetailField = Literal["graph_code", "op_counts", "kernels", "objects"]
DETAIL_FIELDS: tuple[DetailField, ...] = ("graph_code", "op_counts", "kernels", "objects")
MAX_INDEX_VALUE = 1 << 20  # an index entry decodes to no more than this
MAX_DETAILS_BYTES = 16 << 20  # an entry's details are read up to this (they have no size)


def details_name(digest: str) -> str:
    """The blob name of an entry's details (DETAIL_FIELDS), next to its artifact's."""
    return f"{digest}.details"


def index_value(serialized: bytes) -> bytes:
    """An index entry (its EntryMeta's bytes) as Redis holds it: zstd-compressed (key parts
    and signatures are hex and base64: compressed they take about half the memory)."""
    return zstandard.ZstdCompressor(level=3).compress(serialized)


def _parse(key: str, digest: bytes, value: bytes) -> pb.EntryMeta | None:
    """An index entry, or None (logged) if its bytes do not decode: it is never offered, and
    `drop` removes it with the key's other entries."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(value, max_output_size=MAX_INDEX_VALUE)
        if len(raw) > MAX_INDEX_VALUE:
            raise ValueError("too large")
        return pb.EntryMeta.FromString(raw)
    except (DecodeError, ValueError, zstandard.ZstdError):
        log.warning("ignoring undecodable index entry %s of %s", digest.decode()[:16], key[:16])
        return None


def _as_put_wrote_it(field: bytes, entry: pb.EntryMeta) -> bool:
    """Whether an index entry is as `put` writes it: under its digest (a sha256's hex), with
    a stored size (what bounds its blob's read). Any other entry was planted by whoever
    writes the cache's Redis: it is never offered, and the name it holds never reaches the
    blob store (it may name anyone's file)."""
    return (
        keys.DIGEST.fullmatch(entry.digest) is not None
        and field == entry.digest.encode()
        and entry.stored_bytes > 0
    )


def _split(entry: pb.EntryMeta) -> tuple[pb.EntryMeta, pb.EntryMeta]:
    """(the entry without DETAIL_FIELDS, DETAIL_FIELDS alone)."""
    index, details = pb.EntryMeta(), pb.EntryMeta()
    index.CopyFrom(entry)
    for name in DETAIL_FIELDS:
        index.ClearField(name)
    details.CopyFrom(entry)
    for field, _ in entry.ListFields():
        if field.name not in DETAIL_FIELDS:
            details.ClearField(field.name)  # type: ignore[arg-type]
    return index, details


# Remove a key's entries (ARGV[1] "all", or "these" and their digests) with their usage, in
# the key's slot; the whole key once it has none. KEYS: its index, its usage.
# Returns {entries left, {digest, index value, ...} of those removed}.
_DROP = """
local found = {}
if ARGV[1] == 'all' then
  found = redis.call('HGETALL', KEYS[1])
else
  for i = 2, #ARGV do
    local value = redis.call('HGET', KEYS[1], ARGV[i])
    if value then
      table.insert(found, ARGV[i])
      table.insert(found, value)
    end
  end
end
for i = 1, #found, 2 do
  redis.call('HDEL', KEYS[1], found[i])
  redis.call('HDEL', KEYS[2], found[i] .. ':hits', found[i] .. ':last_hit')
end
local left = redis.call('HLEN', KEYS[1])
if left == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
end
return {left, found}
"""


class ArtifactCache:
    """Entries per key (index, usage, LRU order, totals) over a blob backend."""

    def __init__(
        self,
        client: CacheClient,
        blobs: BlobBackend | None = None,
        codec=None,
        verified: VerifiedBlobs | None = None,
        counters: Counters | None = None,
    ):
        self.redis = client
        self.counters = counters if counters is not None else Counters(client)
        self.blobs: BlobBackend = blobs if blobs is not None else RedisBlobs(client)
        self.codec: Codec = codec or Codec()
        self.verified = verified if verified is not None else VerifiedBlobs()
        self._drop = client.register_script(_DROP)  # type: ignore[union-attr]  # (types-redis lacks the cluster's)

    def _use(self, key: str, when: float) -> None:
        """`key` is the most recently used (it joins the LRU order if new)."""
        self.redis.zadd(keys.RECENT, {key: when})

    # ---- the blob store ----------------------------------------------------------------
    def record_store(self) -> None:
        """A worker's, at start: its blob store is the cache's from now on."""
        self.redis.set(keys.BLOB_STORE, self.blobs.where)

    def check_store(self) -> None:
        """Raise WrongBlobStore if the cache's workers recorded another blob store: read
        through the wrong one, every entry would look corrupt and be dropped."""
        recorded = self.redis.get(keys.BLOB_STORE)
        if recorded is not None and recorded.decode() != self.blobs.where:
            raise WrongBlobStore(
                f"this cache's blobs live in {recorded.decode()} (its workers say so), "
                f"but TORCHFARM_BLOB_URL names {self.blobs.where}"
            )

    # ---- reads -------------------------------------------------------------------------
    def keys(self) -> list[tuple[str, float]]:
        """Every key with entries, least recently used first, with its last use time."""
        return [(k.decode(), t) for k, t in self.redis.zrange(keys.RECENT, 0, -1, withscores=True)]

    def entries(self, key: str, usage: bool = True) -> list[pb.EntryMeta]:
        """Entries for a key, newest first, with their usage filled in (unless `usage` is
        False: one Redis round trip less, for a hit that only serves one). An entry that does
        not decode or is not as `put` wrote it is dropped (and counted) as it is read."""
        raw = self.redis.hgetall(keys.index(key))
        used = self.redis.hgetall(keys.usage(key)) if usage else {}
        counts = {k.decode(): float(v) for k, v in used.items()}
        found, bad = [], []
        for digest, value in raw.items():
            meta = _parse(key, digest, value)
            if meta is None or not _as_put_wrote_it(digest, meta):
                bad.append(digest)
                continue
            meta.hits = int(counts.get(f"{meta.digest}:hits", 0))
            meta.last_hit = counts.get(f"{meta.digest}:last_hit", 0.0)
            found.append(meta)
        if bad:
            self.drop(key, bad)
        return sorted(found, key=lambda e: e.created, reverse=True)

    def entry(self, key: str, digest: str) -> pb.EntryMeta | None:
        return next((e for e in self.entries(key) if e.digest == digest), None)

    def with_details(self, entry: pb.EntryMeta) -> pb.EntryMeta:
        """The entry with its DETAIL_FIELDS from the blob store (one read); without them if
        they are gone or do not decode (they are descriptive only: nothing loads them)."""
        full = pb.EntryMeta()
        full.CopyFrom(entry)
        value = self.blobs.get(details_name(entry.digest), MAX_DETAILS_BYTES)
        if value is not None:
            try:
                full.MergeFrom(pb.EntryMeta.FromString(value))
            except DecodeError:
                log.warning("ignoring undecodable details of entry %s", entry.digest[:16])
        return full

    def used_bytes(self) -> float:
        """What counts in the byte budget: stored blobs and tenants' Dynamo packages (whose
        per-tenant budgets bound them; gateway/packages.py)."""
        totals = self.totals()
        return totals.get("stored_bytes", 0) + totals.get("package_bytes", 0)

    def totals(self) -> dict[str, float]:
        """stored_bytes and entries over the whole cache."""
        return {k.decode(): float(v) for k, v in self.redis.hgetall(keys.TOTALS).items()}

    def stored(self, key: str, entry: pb.EntryMeta) -> bytes | None:
        """The entry's stored (encoded) bytes, verified; None (and the entry dropped) if bad.
        The gateway streams them as stored, or through Codec.chunks, never holding the
        artifact decoded; it reads no more than the entry's recorded stored size."""
        kept = self.verified.fresh(entry.digest)
        if kept is not None:
            return kept
        stored = self.blobs.get(entry.digest, entry.stored_bytes)
        if stored is not None and self.verified.holds(entry.digest, stored):
            return stored
        if (
            stored is None
            or len(stored) != entry.stored_bytes
            or not self.codec.verify(stored, entry.digest, entry.size)
        ):
            self.verified.forget(entry.digest)
            self.drop(key, [entry.digest])
            return None
        self.verified.remember(entry.digest, stored)
        return stored

    def read(self, key: str, entry: pb.EntryMeta) -> bytes | None:
        """The artifact bytes of an entry, verified; None (and the entry dropped) if bad."""
        stored = self.stored(key, entry)
        return None if stored is None else b"".join(self.codec.chunks(stored, entry.size))

    # ---- writes ------------------------------------------------------------------------
    def put(self, key: str, data: bytes, meta: pb.EntryMeta) -> pb.EntryMeta:
        """Store `data` under `key` with `meta` (digest, sizes and creation time filled in):
        the blob and the entry's details first, then its index entry (without the details),
        so no entry ever names a missing blob; then the totals (another slot of a cluster:
        a crash just before leaves them one entry short). Raises CacheFull (with nothing
        kept) when storage is full."""
        entry = pb.EntryMeta()
        entry.CopyFrom(meta)
        stored = self.codec.encode(data)
        entry.digest, entry.size, entry.stored_bytes = digest_of(data), len(data), len(stored)
        entry.created = entry.created or time.time()
        entry.ClearField("hits")
        entry.ClearField("last_hit")
        index, details = _split(entry)
        written = [entry.digest, details_name(entry.digest)]
        self.blobs.put(entry.digest, stored)
        try:
            if details.ByteSize():
                self.blobs.put(written[1], details.SerializeToString())
            # The key joins the LRU order before its entry exists (a crash after this leaves
            # a key without entries there, which eviction passes over) and again after (a
            # drop that emptied the key in between may have taken it out; see drop).
            self._use(key, time.time())
            self.redis.hset(keys.index(key), entry.digest, index_value(index.SerializeToString()))
        except OutOfMemoryError as e:  # no entry names the blob: nothing is kept
            self.blobs.delete(written)
            raise CacheFull(str(e)) from e
        except BaseException:  # no object without its entry (a lost reply: a miss, rebuilt)
            with contextlib.suppress(Exception):  # the first failure is the one to report
                self.blobs.delete(written)
            raise
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(keys.RECENT, {key: time.time()})
        pipe.hincrbyfloat(keys.TOTALS, "stored_bytes", len(stored))
        pipe.hincrbyfloat(keys.TOTALS, "entries", 1)
        try:
            pipe.execute()
        except OutOfMemoryError:  # the entry is stored and in the LRU order: only counts lag
            log.warning("the cache's Redis is at its memory limit: totals of %s not counted", key)
        return entry

    def put_new(self, key: str, data: bytes, meta: pb.EntryMeta) -> str:
        """Operator only (`torchfarm cache import`): store unless the entry exists."""
        digest = digest_of(data)
        if self.entry(key, digest) is None:
            self.put(key, data, meta)
        return digest

    def record_hit(
        self,
        key: str,
        digest: str,
        pipe: CachePipeline | None = None,
        hits: int = 1,
        when: float | None = None,
    ) -> None:
        """An entry was served `hits` times, last at `when` (now): count them, and the key
        becomes the most recently used; into `pipe` (which the caller executes, with other
        bookkeeping: one round trip) if given."""
        own = pipe is None
        when = time.time() if when is None else when
        pipe = self.redis.pipeline(transaction=False) if pipe is None else pipe
        pipe.hincrby(keys.usage(key), f"{digest}:hits", hits)
        pipe.hset(keys.usage(key), f"{digest}:last_hit", when)
        pipe.zadd(keys.RECENT, {key: when}, xx=True)
        if not own:
            return
        try:
            pipe.execute()
        except OutOfMemoryError:
            log.warning("the cache's Redis is at its memory limit: hit of %s not recorded", key)

    def drop(self, key: str, digests: Sequence[str | bytes] | None = None) -> int:
        """Remove entries of `key` (all if `digests` is None), then their blobs and details;
        the number removed. The key leaves the LRU order once it has none. Entries not as
        `put` wrote them (_as_put_wrote_it) leave the index only, and are counted as
        `bad_entries`: never counted in the totals, their names never reach the store."""
        left, found = self._drop(
            keys=[keys.index(key), keys.usage(key)],
            args=["all" if digests is None else "these", *(digests or [])],
        )
        removed = [
            meta
            for digest, value in zip(found[::2], found[1::2], strict=True)
            if (meta := _parse(key, digest, value)) is not None and _as_put_wrote_it(digest, meta)
        ]
        bad = len(found) // 2 - len(removed)
        pipe = self.redis.pipeline(transaction=False)
        if removed:
            pipe.hincrbyfloat(keys.TOTALS, "stored_bytes", -sum(e.stored_bytes for e in removed))
            pipe.hincrbyfloat(keys.TOTALS, "entries", -len(removed))
        if not left:
            pipe.zrem(keys.RECENT, key)
        pipe.execute()
        if not left and self.redis.exists(keys.index(key)):
            self._use(key, time.time())  # a put stored an entry meanwhile: it keeps its place
        if bad:
            log.warning("dropped %d index entries of %s naming no blob of theirs", bad, key[:16])
            self.counters.count(bad_entries=bad)
        for entry in removed:
            self.verified.forget(entry.digest)
        self.blobs.delete(n for e in removed for n in (e.digest, details_name(e.digest)))
        return len(found) // 2

    def evict(self, max_bytes: int, ttl_s: float = 0, now: float | None = None) -> list[str]:
        """Drop keys unused for `ttl_s` (0: no TTL), then least recently used keys until the
        stored bytes fit `max_bytes` (0: no budget). The keys dropped, oldest first."""
        now = time.time() if now is None else now
        dropped = []
        if ttl_s > 0:
            for key in self.redis.zrangebyscore(keys.RECENT, "-inf", now - ttl_s):
                self.drop(key.decode())
                dropped.append(key.decode())
        while max_bytes > 0 and self.used_bytes() > max_bytes:
            oldest = self.redis.zrange(keys.RECENT, 0, 0)
            if not oldest:
                break
            self.drop(oldest[0].decode())
            dropped.append(oldest[0].decode())
        return dropped
