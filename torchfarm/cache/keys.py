"""Every Redis key and channel torchfarm uses, and nothing else. The prefix carries the
format version, so an upgrade never reads old data as new (tf2: entries, outcomes and stages
are protobuf messages and enums; tf3: an entry's guards are a ShapeGuards tree, not text;
tf4: artifacts hold AOTAutograd's bundled entry, loaded from memory, ARTIFACT_FORMAT 3;
tf5: index entries are zstd-compressed and their bulky details live beside the blob; tf6:
keys carry Redis Cluster hash tags).

Two servers may hold them: the cache (index, usage, counters; blobs too where
TORCHFARM_BLOB_URL=redis, else they live in the store it names: cache/blobs.py) and the
broker's Redis (jobs, claims, stages, outcomes, notifications and pools, next to Celery's
queues), so a full cache never stops a compile from being queued and answered.

The cache's Redis may be a Redis (or Valkey) Cluster. A hash tag (the part of a name between
the first `{` and `}`) picks the slot, so every multi-key command or script stays in one slot:
a cache key's index and usage share the key's tag; a tenant's packages and their ledger share
the tenant's. What spans slots (the LRU order, the totals and counters beside an entry) is
written in separate commands, ordered so that a crash or a race never leaves an entry outside
the LRU order (cache/artifacts.py). The broker's Redis stays one server: Celery's queues and
the job board's scripts (cache/jobs.py) need it."""

import hashlib
import re

from torchfarm.errors import TorchfarmError

FORMAT = "tf6"
DIGEST = re.compile(r"[0-9a-f]{64}")  # sha256, hex: what names an artifact
_BLOB_NAME = re.compile(rf"{DIGEST.pattern}(\.details)?")


class BadBlobName(TorchfarmError, ValueError):
    """A blob name that is no sha256 digest: read back from a store that a hostile writer may
    have changed (an index entry naming `../x`), it never becomes a path or an object name."""


def blob_name(name: str) -> str:
    """`name` if it is a blob's: an artifact's digest (64 lowercase hex digits) or its
    details' (the digest and `.details`), else BadBlobName. Every blob's Redis key, file path
    and object name is made from what passed here, and nothing else."""
    if not isinstance(name, str) or not _BLOB_NAME.fullmatch(name):
        raise BadBlobName(f"not a blob name: {str(name)[:80]!r}")
    return name


def blob(digest: str) -> str:  # zstd(artifact bytes), content-addressed by sha256
    return f"{FORMAT}:blob:{blob_name(digest)}"  # where TORCHFARM_BLOB_URL=redis (blobs.py)


def blob_object(digest: str) -> str:  # the same bytes' name in a file or S3 blob store:
    name = blob_name(digest)  # a path, fanned out by the digest's start
    return f"{FORMAT}/blob/{name[:2]}/{name}"


def index(key: str) -> str:  # hash: artifact digest -> EntryMeta bytes
    return f"{FORMAT}:index:{{{key}}}"  # the key (hex) is the hash tag: one slot with usage


def usage(key: str) -> str:  # hash: "{digest}:hits" / "{digest}:last_hit" per entry
    return f"{FORMAT}:usage:{{{key}}}"


def structure(tenant: str, digest: str) -> str:  # sorted set: key -> stored time, the keys
    return f"{FORMAT}:structure:{tenant}:{digest}"  # of entries `tenant` made of this graph
    # structure (explaining misses): a tenant's own group, which no other tenant's compile joins


def program(tenant: str, head: str) -> str:  # hash: position -> ManifestEntry, what a tenant's
    return f"{FORMAT}:program:{tenant}:{head}"  # program (first graph's key `head`) was served


# A job is one compile: a key plus the size hints of one trace (see contract.cache_key.job_id).
def claim(job: str) -> str:  # single-flight: who compiles this job now
    return f"{FORMAT}:claim:{job}"


def job(job: str) -> str:  # the payload a worker compiles (short-lived)
    return f"{FORMAT}:job:{job}"


def stage(job: str) -> str:  # the job's Progress.Stage number, for progress
    return f"{FORMAT}:stage:{job}"


def alive(job: str) -> str:  # set while a worker runs the job, refreshed: a running job
    return f"{FORMAT}:alive:{job}"  # without it lost its worker (waiters take it over)


def outcome(job: str) -> str:  # JobOutcome bytes: how the job ended (short-lived)
    return f"{FORMAT}:outcome:{job}"


def failed(job: str) -> str:  # why the graph itself failed to compile: not retried
    return f"{FORMAT}:failed:{job}"  # for TORCHFARM_FAILURE_MEMORY


def uncached(job: str) -> str:  # hash {meta, blob}: the artifact when the cache was full
    return f"{FORMAT}:uncached:{job}"


def waiters(job: str) -> str:  # sorted set: waiter id -> expiry (Redis time), refreshed
    return f"{FORMAT}:waiters:{job}"  # while its RPC waits; no live member = abandoned


def tenant_jobs(tenant: str) -> str:  # sorted set: job -> expiry; the tenant's queued and
    return f"{FORMAT}:tenantjobs:{tenant}"  # running jobs, for TORCHFARM_TENANT_MAX_COMPILES


def events(job: str) -> str:  # pub/sub channel: the job's stage or outcome changed
    return f"{FORMAT}:events:{job}"


def pool(name: str) -> str:  # a live pool's description, kept alive by its workers
    return f"{FORMAT}:pool:{name}"


def pool_stats(name: str) -> str:  # hash of one pool's counters
    return f"{FORMAT}:poolstats:{name}"


def kernel_generation(pool: str) -> str:  # integer: raised to make the pool's workers
    return f"{FORMAT}:kernelgen:{pool}"  # discard their kernel caches (cache/pools.py)


def pool_tuning(pool: str) -> str:  # set: KernelBuild bytes whose build the pool kept tuning
    return f"{FORMAT}:pooltuning:{pool}"  # of; rebuilt by each worker of it, never trusted


BLOB_PATTERN = f"{FORMAT}:blob:*"
POOL_PATTERN = f"{FORMAT}:pool:*"
POOL_TUNING_PATTERN = f"{FORMAT}:pooltuning:*"
POOL_STATS_PATTERN = f"{FORMAT}:poolstats:*"
STATS = f"{FORMAT}:stats"  # hash of farm-wide counters
TOTALS = f"{FORMAT}:totals"  # hash: the cache's stored_bytes and entries, kept with the index
RECENT = f"{FORMAT}:recent"  # sorted set: key -> last use (stored or hit), for LRU
BLOB_STORE = f"{FORMAT}:blobstore"  # string: which blob store holds the cache's blobs


def tenant_tag(tenant: str) -> str:  # a tenant's hash tag: hex, whatever its name holds
    return hashlib.sha256(tenant.encode()).hexdigest()[:16]  # (a `}` in it would cut a tag)


def tenant_packages(tenant: str) -> str:  # hash: package key -> its bytes, one tenant's
    return f"{FORMAT}:tenantpackages:{{{tenant_tag(tenant)}}}:{tenant}"  # packages, for
    # TORCHFARM_TENANT_PACKAGE_MB; one slot with them (its script reads both)


def package(tenant: str, scoped: str) -> str:  # a tenant's Dynamo package; `scoped` =
    return f"{FORMAT}:package:{{{tenant_tag(tenant)}}}:{scoped}"  # gateway/packages.py's hash
    # of (tenant, client's key): never the client's key
