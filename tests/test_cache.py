"""The cache: entries with metadata, LRU eviction within a byte budget, TTL, and every
`torchfarm cache` command against a real redis-server holding real compiled entries."""

import dataclasses
import hashlib
import json
import os
import time

import pytest
import redis
import torch
from typer.testing import CliRunner

from torchfarm.cache import keys
from torchfarm.cache.store import Store
from torchfarm.cli import app
from torchfarm.client import remote
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings

from conftest import TOKENS, direct_request

pytestmark = pytest.mark.integration


def _request(width: int, mode: str = "default") -> pb.CompileRequest:
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU())
    return direct_request(model, torch.randn(4, 16), mode=mode)


def _cli(*args: str) -> dict | list:
    result = CliRunner().invoke(app, ["cache", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.fixture
def scratch(farm) -> Store:
    """An empty Redis database on the farm's server, for synthetic entries."""
    client = redis.Redis.from_url(farm.redis_url.rsplit("/", 1)[0] + "/3")
    client.flushdb()
    yield Store(client)
    client.flushdb()


def _put(store: Store, n: int, size: int = 20_000) -> str:
    key = hashlib.sha256(f"key{n}".encode()).hexdigest()
    store.import_entry(key, os.urandom(size), {"mode": "default", "target": f"cpu test{n}"})
    return key


def _consistent(store: Store) -> None:
    """Every index entry's blob exists, and the byte counter is the sum of the entries."""
    total = 0
    for key, _ in store.keys():
        entries = store.entries(key)
        assert entries
        for e in entries:
            assert store.redis.exists(keys.blob(e["digest"]))
            total += e["stored_bytes"]
    assert store.stats().get("stored_bytes", 0) == total


def test_eviction_drops_least_recently_used_keys_to_fit_the_budget(scratch):
    made = [_put(scratch, n) for n in range(6)]
    entry_bytes = scratch.entries(made[0])[0]["stored_bytes"]
    scratch.record_hit(made[0], scratch.entries(made[0])[0], 1)  # oldest, but just used
    dropped = scratch.evict(max_bytes=int(3.5 * entry_bytes))
    assert dropped == made[1:4]
    assert {k for k, _ in scratch.keys()} == {made[0], *made[4:]}
    _consistent(scratch)


def test_ttl_drops_keys_unused_for_that_long(scratch):
    old, fresh = _put(scratch, 1), _put(scratch, 2)
    scratch.redis.zadd(keys.RECENT, {old: time.time() - 7200})
    assert scratch.evict(max_bytes=0, ttl_s=3600) == [old]
    assert [k for k, _ in scratch.keys()] == [fresh]
    _consistent(scratch)


def test_cli_without_redis_says_how_to_point_it_there(monkeypatch):
    monkeypatch.setenv("TORCHFARM_REDIS_URL", "redis://127.0.0.1:1/0")
    result = CliRunner().invoke(app, ["cache", "stats"])
    assert result.exit_code == 2 and "cannot reach Redis" in result.output


def test_purge_older_than_and_rm(scratch, farm):
    url = farm.redis_url.rsplit("/", 1)[0] + "/3"
    old, fresh, other = _put(scratch, 1), _put(scratch, 2), _put(scratch, 3)
    scratch.redis.zadd(keys.RECENT, {old: time.time() - 3 * 86400})
    assert _cli("purge", "--older-than", "2d", "--redis", url)["keys_removed"] == 1
    assert _cli("rm", other[:12], "--redis", url)["entries_removed"] == 1
    assert [r["key"] for r in _cli("ls", "--redis", url)] == [fresh]
    _consistent(scratch)


def test_cache_cli_on_real_compiled_entries(farm, store, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHFARM_REDIS_URL", farm.redis_url)
    settings = dataclasses.replace(ClientSettings(token=TOKENS["bob"]), addr=farm.addr)
    first, second = _request(24), _request(40, mode="max-autotune-no-cudagraphs")
    header, _ = remote.fetch(first, settings)
    remote.fetch(second, settings)
    again, _ = remote.fetch(first, settings)
    assert again.source == "hit" and again.digest == header.digest

    rows = {r["key"]: r for r in _cli("ls", "--tenant", "bob", "--limit", "0")}
    row = rows[header.key]
    assert row["hits"] >= 1 and row["last_hit"] >= row["created"] > 0
    assert row["mode"] == "default" and row["tenant"] == "bob"
    assert row["compile_seconds"] > 0 and row["size"] > 0 and row["torch_version"]
    assert row["target"].startswith("cpu") and row["pool"].startswith("cpu-")
    assert [r["mode"] for r in _cli("ls", "--tenant", "bob", "--mode",
                                     "max-autotune-no-cudagraphs")] == \
        ["max-autotune-no-cudagraphs"]

    shown = _cli("show", header.key[:20])
    entry = shown["entries"][0]
    assert "linear" in entry["graph_code"] and entry["op_counts"]
    assert any(k["name"].startswith("cpp_") and k["source_bytes"] > 0 for k in entry["kernels"])
    assert entry["objects"] and all(o["bytes"] > 0 for o in entry["objects"])
    for view in (["show", header.key], ["ls"], ["stats"]):  # the tables people read
        result = CliRunner().invoke(app, ["cache", *view])
        assert result.exit_code == 0, (view, result.output)
        assert (header.key[:16] if view != ["stats"] else "compile s") in result.output, view

    stats = _cli("stats")
    assert {"entries", "bytes", "hits", "misses"} <= set(stats)
    assert stats["entries"] >= 2 and stats["hits"] >= 1 and stats["misses"] >= 2
    assert stats["compile_seconds_saved"] > 0
    assert stats["pools"][row["pool"]]["entries"] >= 2

    bundle = tmp_path / "warm.tfbundle"
    assert _cli("export", str(bundle))["entries"] >= 2
    assert _cli("rm", header.key)["entries_removed"] == 1
    assert header.key not in {r["key"] for r in _cli("ls", "--limit", "0")}
    assert _cli("import", str(bundle))["entries"] >= 2
    restored, _ = remote.fetch(first, settings)
    assert restored.source == "hit" and restored.digest == header.digest

    pool = f"--target={row['pool']}"
    assert _cli("purge", pool)["keys_removed"] >= 2
    assert not _cli("ls", pool) and _cli("stats")["pools"][row["pool"]]["entries"] == 0

    damaged = tmp_path / "damaged.tfbundle"
    raw = bytearray(bundle.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    result = CliRunner().invoke(app, ["cache", "import", str(damaged)])
    assert result.exit_code != 0
    assert "nothing imported" in result.output or "not a torchfarm bundle" in result.output
