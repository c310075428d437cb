"""The cache's index on a real three-master Redis Cluster (tests/redis_cluster.py): every
multi-key command and script stays in one slot (keys.py's hash tags), entries spread over the
masters, and the LRU order keeps every key that holds entries when a put and a drop of the
same key interleave (each run at the other's worst moment, through the real client).
test_store.py runs eviction, TTL and the CLI on the cluster too."""

import hashlib
import os

import pytest
import redis
from typer.testing import CliRunner

from torchfarm.cache import keys
from torchfarm.cache.store import Store, connect_cache
from torchfarm.cli import app
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import broker_url


@pytest.fixture
def cluster_store(redis_cluster_url, redis_url) -> Store:
    client = connect_cache(redis_cluster_url)
    assert isinstance(client, redis.RedisCluster)
    client.flushdb()
    yield Store.from_url(redis_cluster_url, broker_url(redis_url, ""))
    client.flushdb()


def _key(n: int) -> str:
    return hashlib.sha256(f"cluster{n}".encode()).hexdigest()


def test_a_key_lives_in_one_slot_and_keys_spread_over_the_masters(cluster_store):
    artifacts = cluster_store.artifacts
    for n in range(24):
        artifacts.put(_key(n), os.urandom(1000), pb.EntryMeta(mode="default"))
        artifacts.record_hit(_key(n), artifacts.entries(_key(n))[0].digest)
    slot = artifacts.redis.keyslot
    for n in range(24):
        assert slot(keys.index(_key(n))) == slot(keys.usage(_key(n)))
        assert artifacts.entries(_key(n))[0].hits == 1
    a, b = "tenant-a", "tenant}{with braces"
    assert slot(keys.tenant_packages(a)) == slot(keys.package(a, "0" * 64))
    assert slot(keys.tenant_packages(b)) == slot(keys.package(b, "0" * 64))
    masters = {artifacts.redis.get_node_from_key(keys.index(_key(n))).port for n in range(24)}
    assert len(masters) == 3  # 24 keys over 16384 slots in three ranges: all three are used
    assert artifacts.totals() == {
        "stored_bytes": pytest.approx(
            sum(artifacts.entries(_key(n))[0].stored_bytes for n in range(24))
        ),
        "entries": 24.0,
    }
    assert sum(artifacts.drop(_key(n)) for n in range(24)) == 24
    assert artifacts.keys() == [] and artifacts.totals()["entries"] == 0


def _in_lru_order_if_held(artifacts, key: str) -> None:
    """The invariant eviction needs: a key that holds entries is in the LRU order; and the
    totals are the entries'."""
    entries = artifacts.entries(key)
    assert entries, "the put's entry should be kept"
    assert key in {k for k, _ in artifacts.keys()}
    assert artifacts.totals()["stored_bytes"] == pytest.approx(entries[0].stored_bytes)


def test_a_drop_between_a_puts_two_steps_leaves_the_key_in_the_lru_order(
    cluster_store, monkeypatch
):
    """A put enters the key in the LRU order, then writes its entry: a drop of the same key
    in between (another slot: no transaction spans both) takes the key out of the order."""
    artifacts, key = cluster_store.artifacts, _key(100)
    artifacts.put(key, b"first", pb.EntryMeta(mode="a"))
    real_hset = artifacts.redis.hset

    def drop_first(name, *args, **kwargs):
        if name == keys.index(key):
            monkeypatch.setattr(artifacts.redis, "hset", real_hset)
            assert artifacts.drop(key) == 1
            assert key not in {k for k, _ in artifacts.keys()}
        return real_hset(name, *args, **kwargs)

    monkeypatch.setattr(artifacts.redis, "hset", drop_first)
    artifacts.put(key, b"second", pb.EntryMeta(mode="b"))
    _in_lru_order_if_held(artifacts, key)


def test_a_put_between_a_drops_two_steps_leaves_the_key_in_the_lru_order(
    cluster_store, monkeypatch
):
    """A drop empties the key in its slot, then takes it out of the LRU order: a put of the
    same key in between must not be left out of the order."""
    artifacts, key = cluster_store.artifacts, _key(101)
    artifacts.put(key, b"first", pb.EntryMeta(mode="a"))
    real_drop = artifacts._drop

    def put_after(**kwargs):
        found = real_drop(**kwargs)
        artifacts.put(key, b"second", pb.EntryMeta(mode="b"))
        return found

    monkeypatch.setattr(artifacts, "_drop", put_after)
    assert artifacts.drop(key) == 1
    _in_lru_order_if_held(artifacts, key)


def test_the_broker_must_be_one_server(redis_cluster_url, monkeypatch):
    """Celery's queues and the job board's scripts need one server: a cluster as the cache
    needs a broker named, and a cluster as the broker is refused, each saying what to set."""
    with pytest.raises(ValueError, match="set TORCHFARM_BROKER_URL"):
        broker_url(redis_cluster_url, "")
    with pytest.raises(ValueError, match="needs a single Redis"):
        broker_url("redis://127.0.0.1:6379/0", redis_cluster_url)
    monkeypatch.delenv("TORCHFARM_BROKER_URL", raising=False)
    result = CliRunner().invoke(app, ["cache", "stats", "--redis", redis_cluster_url])
    assert result.exit_code == 2 and "TORCHFARM_BROKER_URL" in result.output
