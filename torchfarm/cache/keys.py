"""Every Redis key torchfarm uses, and nothing else. The prefix carries the format version,
so an upgrade never reads old data as new.

Two servers may hold them: the cache (blobs, index, usage, counters) and the broker's Redis
(jobs, claims, statuses and pools, next to Celery's queues), so a full cache never stops a
compile from being queued and answered."""

FORMAT = "tf1"


def blob(digest: str) -> str:  # zstd(artifact bytes), content-addressed by sha256
    return f"{FORMAT}:blob:{digest}"


def index(key: str) -> str:  # hash: artifact digest -> entry metadata (JSON)
    return f"{FORMAT}:index:{key}"


def usage(key: str) -> str:  # hash: "{digest}:hits" / "{digest}:last_hit" per entry
    return f"{FORMAT}:usage:{key}"


# A job is one compile: a key plus the size hints of one trace (see cache_key.job_id).
def claim(job: str) -> str:  # single-flight: who compiles this job now
    return f"{FORMAT}:claim:{job}"


def job(job: str) -> str:  # the payload a worker compiles (short-lived)
    return f"{FORMAT}:job:{job}"


def status(job: str) -> str:  # queued / compiling, for progress
    return f"{FORMAT}:status:{job}"


def error(job: str) -> str:  # why the job failed (short-lived)
    return f"{FORMAT}:error:{job}"


def failed(job: str) -> str:  # why the graph itself failed to compile: not retried
    return f"{FORMAT}:failed:{job}"  # for TORCHFARM_FAILURE_MEMORY


def done(job: str) -> str:  # the digest of the entry the job stored (short-lived)
    return f"{FORMAT}:done:{job}"


def uncached(job: str) -> str:  # the job's artifact when the cache was full (short-lived)
    return f"{FORMAT}:uncached:{job}"


def pool(name: str) -> str:  # a live pool's description, kept alive by its workers
    return f"{FORMAT}:pool:{name}"


def pool_stats(name: str) -> str:  # hash of one pool's counters
    return f"{FORMAT}:poolstats:{name}"


POOL_PATTERN = f"{FORMAT}:pool:*"
POOL_STATS_PATTERN = f"{FORMAT}:poolstats:*"
STATS = f"{FORMAT}:stats"  # hash of farm-wide counters
RECENT = f"{FORMAT}:recent"  # sorted set: key -> last use (stored or hit), for LRU
