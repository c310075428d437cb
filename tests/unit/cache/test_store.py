"""The store against a bare redis-server: LRU eviction within a byte budget, TTL, and the
cache CLI's purge and rm on synthetic entries."""

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchfarm.cache import keys
from torchfarm.cache.blobs import FileBlobs, open_blobs
from torchfarm.cache.store import Store, connect, connect_cache
from torchfarm.cli import app
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import broker_url


@pytest.fixture(params=["redis", "file", "cluster"])
def scratch_url(request, redis_url, tmp_path, monkeypatch) -> str:
    """The cache's URL for `scratch`: a bare redis-server holding the index and the blobs,
    the same with the blobs in a directory (cache/blobs.py), or a real three-master Redis
    Cluster (keys.py's hash tags) with the bare server as its broker. The cache CLI's
    commands see the same (TORCHFARM_BLOB_URL, TORCHFARM_BROKER_URL)."""
    blob_url = f"file://{tmp_path}/blobs" if request.param == "file" else "redis"
    monkeypatch.setenv("TORCHFARM_BLOB_URL", blob_url)
    monkeypatch.setenv("TORCHFARM_BROKER_URL", broker_url(redis_url, ""))
    if request.param == "cluster":
        return request.getfixturevalue("redis_cluster_url")
    return redis_url


@pytest.fixture
def scratch(scratch_url, redis_url) -> Store:
    """An empty cache at `scratch_url`, for synthetic entries."""
    client = connect_cache(scratch_url)
    client.flushdb()
    blobs = open_blobs(os.environ["TORCHFARM_BLOB_URL"], client)
    yield Store.from_clients(client, connect(broker_url(redis_url, "")), blobs)
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


def _blobs_kept(store: Store) -> set[str]:
    """The names of every blob the store holds, index or not (_put's entries have no
    details)."""
    blobs = store.artifacts.blobs
    if isinstance(blobs, FileBlobs):
        return {p.name for p in Path(blobs.root).rglob("*") if p.is_file()}
    return {
        k.decode().rsplit(":", 1)[1] for k in store.artifacts.redis.scan_iter(keys.BLOB_PATTERN)
    }


def _consistent(store: Store) -> None:
    """Every index entry's blob exists, no blob without an entry is left behind, and the
    byte counter is the sum of the entries."""
    total, named = 0, set()
    for key, _ in store.artifacts.keys():
        entries = store.artifacts.entries(key)
        assert entries
        for e in entries:
            total += e.stored_bytes
            named.add(e.digest)
    assert _blobs_kept(store) == named
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


def test_cli_says_how_to_point_it_at_the_farm(monkeypatch):
    monkeypatch.delenv("TORCHFARM_ADDR", raising=False)
    result = CliRunner().invoke(app, ["cache", "stats"])
    assert result.exit_code == 2 and "--addr and --token" in result.output
    result = CliRunner().invoke(app, ["cache", "stats", "--addr", "127.0.0.1:1", "--token", "t"])
    assert result.exit_code == 1 and "UNAVAILABLE" in result.output
    monkeypatch.setenv("TORCHFARM_REDIS_URL", "redis://:s3cret@127.0.0.1:1/0")  # recovery mode
    result = CliRunner().invoke(app, ["cache", "stats", "--direct"])
    assert result.exit_code == 2 and "cannot reach Redis at redis://:**@127.0.0.1:1/0" in (
        result.output
    )
    assert "s3cret" not in result.output


def test_purge_older_than_and_rm(scratch, scratch_url):
    url = scratch_url
    old, fresh, other = _put(scratch, 1), _put(scratch, 2), _put(scratch, 3)
    scratch.artifacts.redis.zadd(keys.RECENT, {old: time.time() - 3 * 86400})
    assert _cli("purge", "--older-than", "2d", "--redis", url)["keys_removed"] == 1
    assert _cli("rm", other[:12], "--redis", url)["entries_removed"] == 1
    assert [r["key"] for r in _cli("ls", "--redis", url)] == [fresh]
    _consistent(scratch)


def test_drop_kernels_raises_the_generation_of_a_known_pool_only(scratch, scratch_url):
    scratch.pools.redis.delete(keys.kernel_generation("cpu-avx2"))
    refused = CliRunner().invoke(
        app, ["cache", "drop-kernels", "--pool", "cpu-avx2", "--redis", scratch_url]
    )
    assert refused.exit_code == 1 and "no pool 'cpu-avx2'" in refused.output
    scratch.counters.count("cpu-avx2", compiles=1)  # a pool that compiled (or a live one)
    for generation in (1, 2):
        reply = _cli("drop-kernels", "--pool", "cpu-avx2", "--redis", scratch_url)
        assert reply == {"pool": "cpu-avx2", "generation": generation}
    assert scratch.pools.kernel_generation("cpu-avx2") == 2


def test_an_undecodable_index_entry_is_passed_over_dropped_and_counted(scratch):
    key = _put(scratch, 1)
    [good] = scratch.artifacts.entries(key)
    scratch.artifacts.redis.hset(keys.index(key), "0" * 64, b"\xb2\x01\x03 no")  # guards: junk
    assert scratch.artifacts.entries(key) == [good]
    assert scratch.artifacts.redis.hkeys(keys.index(key)) == [good.digest.encode()]
    assert scratch.summary()["bad_entries"] == 1
    assert scratch.artifacts.drop(key) == 1
    assert not scratch.artifacts.redis.exists(keys.index(key))
