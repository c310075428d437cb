"""The store against a bare redis-server: LRU eviction within a byte budget, TTL, and the
cache CLI's purge and rm on synthetic entries."""

import hashlib
import json
import os
import time

import pytest
import redis
from typer.testing import CliRunner

from torchfarm.cache import keys
from torchfarm.cache.store import Store
from torchfarm.cli import app
from torchfarm.proto import torchfarm_pb2 as pb


@pytest.fixture
def scratch(redis_url) -> Store:
    """An empty Redis database, for synthetic entries."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield Store.from_clients(client)
    client.flushdb()


def _cli(*args: str) -> dict | list:
    result = CliRunner().invoke(app, ["cache", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _put(store: Store, n: int, size: int = 20_000) -> str:
    key = hashlib.sha256(f"key{n}".encode()).hexdigest()
    store.artifacts.put_new(
        key, os.urandom(size), pb.EntryMeta(mode="default", target=f"cpu test{n}")
    )
    return key


def _consistent(store: Store) -> None:
    """Every index entry's blob exists, and the byte counter is the sum of the entries."""
    total = 0
    for key, _ in store.artifacts.keys():
        entries = store.artifacts.entries(key)
        assert entries
        for e in entries:
            assert store.artifacts.redis.exists(keys.blob(e.digest))
            total += e.stored_bytes
    assert store.artifacts.totals().get("stored_bytes", 0) == total


def test_eviction_drops_least_recently_used_keys_to_fit_the_budget(scratch):
    made = [_put(scratch, n) for n in range(6)]
    entry_bytes = scratch.artifacts.entries(made[0])[0].stored_bytes
    # oldest, but just used
    scratch.artifacts.record_hit(made[0], scratch.artifacts.entries(made[0])[0].digest)
    dropped = scratch.artifacts.evict(max_bytes=int(3.5 * entry_bytes))
    assert dropped == made[1:4]
    assert {k for k, _ in scratch.artifacts.keys()} == {made[0], *made[4:]}
    _consistent(scratch)


def test_ttl_drops_keys_unused_for_that_long(scratch):
    old, fresh = _put(scratch, 1), _put(scratch, 2)
    scratch.artifacts.redis.zadd(keys.RECENT, {old: time.time() - 7200})
    assert scratch.artifacts.evict(max_bytes=0, ttl_s=3600) == [old]
    assert [k for k, _ in scratch.artifacts.keys()] == [fresh]
    _consistent(scratch)


def test_cli_without_redis_says_how_to_point_it_there(monkeypatch):
    monkeypatch.setenv("TORCHFARM_REDIS_URL", "redis://127.0.0.1:1/0")
    result = CliRunner().invoke(app, ["cache", "stats"])
    assert result.exit_code == 2 and "cannot reach Redis" in result.output


def test_purge_older_than_and_rm(scratch, redis_url):
    url = redis_url
    old, fresh, other = _put(scratch, 1), _put(scratch, 2), _put(scratch, 3)
    scratch.artifacts.redis.zadd(keys.RECENT, {old: time.time() - 3 * 86400})
    assert _cli("purge", "--older-than", "2d", "--redis", url)["keys_removed"] == 1
    assert _cli("rm", other[:12], "--redis", url)["entries_removed"] == 1
    assert [r["key"] for r in _cli("ls", "--redis", url)] == [fresh]
    _consistent(scratch)


def test_an_undecodable_index_entry_is_passed_over_and_dropped_with_its_key(scratch):
    key = _put(scratch, 1)
    [good] = scratch.artifacts.entries(key)
    scratch.artifacts.redis.hset(keys.index(key), "0" * 64, b"\xb2\x01\x03 no")  # guards: junk
    assert scratch.artifacts.entries(key) == [good]
    assert scratch.artifacts.drop(key) == 2
    assert not scratch.artifacts.redis.exists(keys.index(key))
