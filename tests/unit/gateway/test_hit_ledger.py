"""The gateway's hit ledger against a bare redis-server: hits wait in memory and are written
together (usage, LRU order, farm and pool counters) on a flush, by the ledger's own thread
within its interval, and before an Admin command reads."""

import time

from torchfarm.cache import keys
from torchfarm.gateway.hit_ledger import HitLedger
from torchfarm.proto import torchfarm_pb2 as pb


def _entry(store, key: str, data: bytes, pool: str) -> pb.EntryMeta:
    return store.artifacts.put(key, data, pb.EntryMeta(pool=pool, compile_seconds=2.5))


def test_hits_are_written_together_on_a_flush_with_their_sums(store):
    a, b = "a" * 64, "b" * 64
    first, second = _entry(store, a, b"first" * 10, "cpu-x"), _entry(store, b, b"second", "cpu-y")
    store.artifacts.redis.zadd(keys.RECENT, {a: 1.0, b: 1.0})
    ledger = HitLedger(store, flush_s=3600)  # only the explicit flush writes
    before = time.time()
    for _ in range(3):
        ledger.add(a, first)
    ledger.add(b, second)
    assert store.counters.farm().get("hits", 0) == 0  # nothing written yet

    ledger.flush()
    farm, pools = store.counters.farm(), store.counters.per_pool()
    assert farm["hits"] == 4 and farm["bytes_served"] == 3 * first.size + second.size
    assert farm["compile_seconds_saved"] == 4 * 2.5
    assert pools["cpu-x"]["hits"] == 3 and pools["cpu-y"]["hits"] == 1
    (used,) = store.artifacts.entries(a)
    assert used.hits == 3 and used.last_hit >= before
    assert store.artifacts.redis.zscore(keys.RECENT, a) >= before
    ledger.flush()  # nothing new: nothing counted twice
    assert store.counters.farm()["hits"] == 4


def test_the_ledgers_thread_writes_within_its_interval(store):
    key = "c" * 64
    entry = _entry(store, key, b"third", "cpu-x")
    ledger = HitLedger(store, flush_s=0.05)
    ledger.add(key, entry)
    deadline = time.monotonic() + 5
    while store.counters.farm().get("hits", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.counters.farm()["hits"] == 1 and store.artifacts.entries(key)[0].hits == 1
