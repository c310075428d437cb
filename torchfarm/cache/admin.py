"""The cache's operations (list, show, stats, drop, purge, export, import, drop-kernels) over a
Store, with the Admin RPCs' messages as their inputs and outputs.

One implementation for both ways of reaching the cache: the gateway's Admin service runs it
for an admin token, and `torchfarm cache --redis URL` (direct recovery mode) runs it in the
operator's process. The CLI only formats what it returns.
"""

from __future__ import annotations

import collections
import enum
import json
import re
import time
from typing import BinaryIO

import zstandard
from google.protobuf.message import DecodeError

from torchfarm import signing
from torchfarm.cache.artifacts import DETAIL_FIELDS, digest_of
from torchfarm.cache.store import Store, entry_dict, entry_from_dict
from torchfarm.errors import TorchfarmError
from torchfarm.proto import torchfarm_pb2 as pb

BUNDLE_FORMAT = "torchfarm-bundle-v1"
# What the gateway's Import takes (direct mode, the operator's own process, takes any size):
MAX_BUNDLE_BYTES = 256 << 20  # a bundle as uploaded (zstd), spooled to disk as it arrives
# The bytes it may decode to, per byte uploaded: a bundle's entries share objects and code,
# which zstd stores once (two real CPU entries, one default, one max-autotune, decoded past 16
# in a CI run of 2026-11-30); a 4 KB bomb still stops at 512 KB.
MAX_BUNDLE_RATIO = 128
MAX_BUNDLE_DECODED = 1 << 30  # and at most this: it is parsed in memory
BULKY = DETAIL_FIELDS  # fields `ls` leaves out (kept beside the blob, not in the index)
MIN_PREFIX = 4  # hex digits a `show`/`rm` prefix needs
_KEY = re.compile(r"[0-9a-f]{64}")
_SORTS = {
    "age": lambda r: -r.last_used,
    "hits": lambda r: -r.entry.hits,
    "size": lambda r: -r.entry.size,
}


class Problem(enum.Enum):
    """Why an operation refused: the gateway maps each to a gRPC status, the CLI to a message."""

    INVALID = "invalid"  # a bad request or bundle (INVALID_ARGUMENT)
    NOT_FOUND = "not found"  # no key matches (NOT_FOUND)
    UNTRUSTED = "untrusted"  # a bundle entry no trusted key signed (FAILED_PRECONDITION)
    TOO_LARGE = "too large"  # a bundle past the gateway's bounds (RESOURCE_EXHAUSTED)


class CacheOperationRefused(TorchfarmError):
    def __init__(self, problem: Problem, message: str):
        super().__init__(message)
        self.problem = problem


def matches(row: pb.CacheRow, f: pb.EntryFilter, now: float) -> bool:
    e = row.entry
    return (
        (not f.target or f.target in e.target or f.target in e.pool)
        and (not f.mode or e.mode == f.mode)
        and (not f.tenant or e.tenant == f.tenant)
        and (not f.unused_for_s or now - row.last_used >= f.unused_for_s)
    )


class CacheAdmin:
    def __init__(self, store: Store):
        self.store = store

    def _rows(self) -> list[pb.CacheRow]:
        artifacts = self.store.artifacts
        return [
            pb.CacheRow(key=key, last_used=last_used, entry=entry)
            for key, last_used in artifacts.keys()
            for entry in artifacts.entries(key)
        ]

    def _matching(self, f: pb.EntryFilter) -> list[pb.CacheRow]:
        now = time.time()
        return [r for r in self._rows() if matches(r, f, now)]

    def ls(self, request: pb.ListRequest) -> pb.ListReply:
        order = _SORTS.get(request.sort or "age")
        if order is None:
            raise CacheOperationRefused(
                Problem.INVALID, f"sort {request.sort!r}: one of {', '.join(_SORTS)}"
            )
        rows = sorted(self._matching(request.filter), key=order)
        rows = rows[: request.limit] if request.limit > 0 else rows
        for row in rows:
            for name in BULKY:
                row.entry.ClearField(name)  # type: ignore[arg-type]
        return pb.ListReply(rows=rows)

    def show(self, request: pb.ShowRequest) -> pb.ShowReply:
        key = self.resolve(request.key)
        artifacts = self.store.artifacts
        return pb.ShowReply(
            key=key, entries=[artifacts.with_details(e) for e in artifacts.entries(key)]
        )

    def resolve(self, prefix: str) -> str:
        """The one key that starts with `prefix`."""
        if not re.fullmatch(rf"[0-9a-f]{{{MIN_PREFIX},64}}", prefix):
            raise CacheOperationRefused(
                Problem.INVALID, f"{prefix!r}: {MIN_PREFIX} to 64 lowercase hex digits"
            )
        found = [k for k, _ in self.store.artifacts.keys() if k.startswith(prefix)]
        if not found:
            raise CacheOperationRefused(Problem.NOT_FOUND, f"no key starts with {prefix!r}")
        if len(found) > 1:
            raise CacheOperationRefused(
                Problem.INVALID, f"{prefix!r} matches {len(found)} keys; give more of the key"
            )
        return found[0]

    def stats(self) -> pb.StatsReply:
        return pb.StatsReply(json=json.dumps(self.store.summary()))

    def drop(self, request: pb.DropRequest) -> pb.DropReply:
        if not _KEY.fullmatch(request.key):
            raise CacheOperationRefused(Problem.INVALID, "key must be 64 hex digits")
        return pb.DropReply(entries=self.store.artifacts.drop(request.key))

    def purge(self, request: pb.PurgeRequest) -> pb.PurgeReply:
        f = request.filter
        if not (request.all or f.target or f.mode or f.tenant or f.unused_for_s):
            raise CacheOperationRefused(Problem.INVALID, "purge needs a filter, or all")
        keys = sorted({r.key for r in self._matching(f)})
        removed = sum(self.store.artifacts.drop(k) for k in keys)
        return pb.PurgeReply(keys=len(keys), entries=removed)

    def drop_kernels(self, request: pb.DropKernelsRequest) -> pb.DropKernelsReply:
        """Raise the pool's kernel cache generation: each of its workers discards its kernel
        cache for the pool before its next compile (workers/kernel_cache.py)."""
        known = set(self.store.pools.live()) | set(self.store.counters.per_pool())
        if request.pool not in known - {""}:
            pools = ", ".join(sorted(known - {""})) or "none"
            raise CacheOperationRefused(
                Problem.NOT_FOUND, f"no pool {request.pool!r} (pools: {pools})"
            )
        return pb.DropKernelsReply(generation=self.store.pools.drop_kernels(request.pool))

    def export(self, request: pb.ExportRequest) -> bytes:
        """A bundle file's bytes: the matching entries with their artifacts and signatures,
        and every pool's tuning builds."""
        bundle = pb.CacheBundle(format=BUNDLE_FORMAT)
        for row in self._matching(pb.EntryFilter(target=request.filter.target)):
            entry = self.store.artifacts.with_details(row.entry)
            data = self.store.artifacts.read(row.key, entry)
            if data is None:
                continue  # corrupt: dropped by read, not exported
            entry.ClearField("hits")
            entry.ClearField("last_hit")
            bundle.entries.add(
                key=row.key,
                digest=entry.digest,
                meta_json=json.dumps(entry_dict(entry)),
                artifact=data,
            )
        for pool, builds in sorted(self.store.pools.tuning_by_pool().items()):
            bundle.pool_tuning.add(pool=pool, builds=builds)
        return zstandard.ZstdCompressor(level=10).compress(bundle.SerializeToString())

    def import_bundle(
        self,
        source: BinaryIO,
        trusted: signing.Verifier,
        served: tuple[str, ...] | list[str],
        unsigned: bool = False,
        max_decoded: int = 0,
    ) -> pb.ImportReply:
        """Load a bundle's entries (read from `source`, decoded up to `max_decoded` bytes, 0:
        any) once each one's digest, format and signature are checked:
        an entry that no key of `trusted` signed refuses the whole bundle unless `unsigned`.
        Entries keep the signature they came with (never re-signed), recording its key
        (`signed_by`); entries private to a tenant are dropped and counted. `served`: the keys
        the gateway serves clients (the reply names other signers)."""
        bundle = parse_bundle(source, max_decoded)
        entries, untrusted, private = [], [], 0
        now = time.time()
        for item in bundle.entries:
            meta = checked_entry(item)
            if meta.private:
                private += 1
                continue
            meta.signed_by = origin(trusted, item.key, meta) or ""
            meta.imported = now
            if not meta.signed_by:
                untrusted.append(item.key)
            entries.append((item, meta))
        if untrusted and not unsigned:
            names = ", ".join(trusted.public_keys) or "none"
            raise CacheOperationRefused(
                Problem.UNTRUSTED,
                f"{len(untrusted)} of {len(entries)} entries are not signed by a trusted key "
                f"(first: {untrusted[0][:16]}); nothing imported. Trusted keys: {names}",
            )
        for item, meta in entries:
            self.store.artifacts.put_new(item.key, item.artifact, meta)
        # Unsigned and still safe: each is a build's input, which the pool checks and builds
        # itself, as it does a shared compile's report (workers/kernel_builder.py).
        tuning = sum(
            self.store.pools.add_tuning(t.pool, list(t.builds)) for t in bundle.pool_tuning
        )
        signers = collections.Counter(meta.signed_by for _, meta in entries if meta.signed_by)
        return pb.ImportReply(
            entries=len(entries),
            unsigned=len(untrusted),
            private_dropped=private,
            signed_by=dict(signers),
            unserved=sorted(set(signers) - set(served)),
            tuning_builds=tuning,
        )


def decoded_limit(uploaded: int) -> int:
    """The most a bundle of `uploaded` bytes may decode to through the gateway."""
    return min(MAX_BUNDLE_DECODED, MAX_BUNDLE_RATIO * uploaded)


def parse_bundle(source: BinaryIO, max_decoded: int = 0) -> pb.CacheBundle:
    """The bundle in `source`, decoded a chunk at a time: past `max_decoded` bytes (0: no
    limit) it is refused (TOO_LARGE) before more is held."""
    decoded = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(source)
        while piece := reader.read(1 << 20):
            decoded += piece
            if max_decoded and len(decoded) > max_decoded:
                raise CacheOperationRefused(
                    Problem.TOO_LARGE,
                    f"the bundle decodes to more than {max_decoded} bytes "
                    f"({MAX_BUNDLE_RATIO} per byte sent, at most {MAX_BUNDLE_DECODED}); "
                    "nothing imported (direct mode, --redis, takes any size)",
                )
        bundle = pb.CacheBundle.FromString(bytes(decoded))
    except (zstandard.ZstdError, ValueError, DecodeError) as e:
        raise CacheOperationRefused(Problem.INVALID, f"not a torchfarm bundle ({e})") from e
    if bundle.format != BUNDLE_FORMAT:
        raise CacheOperationRefused(
            Problem.INVALID, f"bundle format {bundle.format!r}, expected {BUNDLE_FORMAT!r}"
        )
    return bundle


def checked_entry(item: pb.BundleEntry) -> pb.EntryMeta:
    """An entry's metadata, once its artifact matches its digest, size and guards."""
    try:
        meta = entry_from_dict(json.loads(item.meta_json))
        guards = pb.Artifact.FromString(item.artifact).guards  # protobuf only: no code runs
    except Exception as e:  # JSON, protobuf JSON or protobuf parse errors
        raise CacheOperationRefused(
            Problem.INVALID, f"entry {item.key[:16]} is malformed ({e}); nothing imported"
        ) from e
    if (
        digest_of(item.artifact) != item.digest
        or meta.digest != item.digest
        or meta.size != len(item.artifact)
        or guards != meta.guards
        or not _KEY.fullmatch(item.key)
    ):
        raise CacheOperationRefused(
            Problem.INVALID, f"entry {item.key[:16]} fails its digest check; nothing imported"
        )
    return meta


def origin(trusted: signing.Verifier, key: str, meta: pb.EntryMeta) -> str | None:
    """The trusted key that signed the entry for the graph its index key names, or None: a
    shared entry's index key is the graph's public key itself, which the signature covers."""
    if (meta.public_key or key) != key:
        return None
    return signing.entry_signer(trusted, key, meta)
