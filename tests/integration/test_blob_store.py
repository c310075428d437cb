"""A farm whose blobs live in a real S3-compatible server (SeaweedFS's `weed`, tests/s3_server.py):
a miss stores the artifact's bytes there and only small values in Redis; hits are served from
it; a missing or corrupted object is detected, dropped and rebuilt; eviction removes index
and object together."""

import dataclasses
import os

import pytest
import torch

from tests.integration.helpers import (
    RECHECK_ENV,
    TOKENS,
    direct_request,
    past_gateway_memory,
    run_client,
)
from tests.s3_server import seaweedfs
from torchfarm.cache import keys
from torchfarm.gateway.auth import hash_token
from torchfarm.local_farm import LocalFarm
from torchfarm.settings import ClientSettings

pytestmark = pytest.mark.integration
ALICE = ClientSettings(token=TOKENS["alice"], progress=False)
PREFIX = "farm"  # the farm's objects live under it, in the server's bucket
ENTRY_REDIS_BYTES = 4096  # the target: Redis memory per entry, whatever the artifact's size


@pytest.fixture(scope="module")
def s3_farm():
    tenants = ",".join(f"{name}:{hash_token(tok)}" for name, tok in TOKENS.items())
    with pytest.MonkeyPatch.context() as env, seaweedfs() as s3:
        for name, value in s3.env.items():  # this process's own store reads the bucket too
            env.setenv(name, value)
        with LocalFarm(
            tenants=tenants, blob_url=s3.blob_url(PREFIX), extra_env={**s3.env, **RECHECK_ENV}
        ) as farm:
            yield farm, s3


def _redis_bytes(store, names) -> int:
    return sum(store.artifacts.redis.memory_usage(n) or 0 for n in names)


def _entry_keys(key: str) -> list[str]:
    """The Redis keys that hold an entry: its index and usage hashes (RECENT and TOTALS are
    one sorted set and one hash for the whole cache)."""
    return [keys.index(key), keys.usage(key)]


def test_a_miss_keeps_its_artifact_in_the_object_store_and_redis_only_small_values(s3_farm):
    farm, s3 = s3_farm
    store = farm.store()
    miss = run_client(farm, "model_client.py", "mlp", "infer")
    assert miss["sources"] == ["miss"] and miss["out_err"] < 1e-5
    [(key, _)] = store.artifacts.keys()
    [entry] = store.artifacts.entries(key)
    named = f"{PREFIX}/{keys.blob_object(entry.digest)}"
    assert sorted(s3.objects()) == [named, f"{named}.details"]  # the artifact, its details
    assert not list(store.artifacts.redis.scan_iter(match=keys.BLOB_PATTERN))
    assert _redis_bytes(store, _entry_keys(key)) <= ENTRY_REDIS_BYTES
    hit = run_client(farm, "model_client.py", "mlp", "infer")
    assert hit["sources"] == ["hit"] and hit["out_err"] < 1e-5

    # A multi-MB artifact with the real entry's metadata: Redis holds as much as before.
    big_key, data = "b" * 64, os.urandom(8 << 20)
    recent, totals = (_redis_bytes(store, [n]) for n in (keys.RECENT, keys.TOTALS))
    stored = store.artifacts.put(big_key, data, entry)
    grown = _redis_bytes(store, [keys.RECENT, keys.TOTALS]) - recent - totals
    per_entry = _redis_bytes(store, _entry_keys(big_key)) + grown
    print(f"Redis bytes for one entry of an {len(data) >> 20} MB artifact: {per_entry}")
    assert per_entry <= ENTRY_REDIS_BYTES, per_entry
    assert store.artifacts.read(big_key, stored) == data
    assert store.artifacts.drop(big_key) == 1
    assert f"{PREFIX}/{keys.blob_object(stored.digest)}" not in s3.objects()


@pytest.mark.parametrize("fault", ["missing", "corrupted"])
def test_a_missing_or_corrupted_object_is_dropped_and_rebuilt(s3_farm, fault):
    farm, s3 = s3_farm
    store = farm.store()
    request = direct_request(
        torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh()), torch.randn(2, 7)
    )
    from torchfarm.client import remote

    settings = dataclasses.replace(ALICE, addr=farm.addr)
    header, data = remote.fetch(request, settings)
    name = f"{PREFIX}/{keys.blob_object(header.digest)}"
    bucket = s3.client()
    if fault == "missing":
        bucket.delete_object(Bucket="torchfarm", Key=name)
    else:
        stored = bytearray(bucket.get_object(Bucket="torchfarm", Key=name)["Body"].read())
        stored[len(stored) // 2] ^= 0xFF
        bucket.put_object(Bucket="torchfarm", Key=name, Body=bytes(stored))
    compiles = store.counters.farm().get("compiles", 0)
    past_gateway_memory()
    again, rebuilt = remote.fetch(request, settings)
    assert again.source == "miss" and rebuilt  # detected, never served
    assert store.counters.farm().get("compiles", 0) == compiles + 1
    assert store.artifacts.entry(again.key, again.digest) is not None
    objects = s3.objects()
    assert f"{PREFIX}/{keys.blob_object(again.digest)}" in objects  # the rebuilt artifact
    assert again.digest == header.digest or name not in objects  # the bad one dropped
    assert remote.fetch(request, settings)[0].source == "hit"


def test_eviction_removes_index_and_object_together(s3_farm):
    farm, s3 = s3_farm
    store = farm.store()
    made = store.artifacts.keys()
    assert made and s3.objects(PREFIX)
    dropped = store.artifacts.evict(max_bytes=1)  # the workers' own eviction, budget 1 byte
    assert sorted(dropped) == sorted(k for k, _ in made)
    assert store.artifacts.keys() == [] and store.artifacts.totals()["entries"] == 0
    assert not list(store.artifacts.redis.scan_iter(match=keys.index("*")))
    assert s3.objects(PREFIX) == []  # no orphan left in the bucket


def test_a_worker_with_an_unreachable_blob_store_refuses_to_start(s3_farm):
    farm, _ = s3_farm
    proc = farm.start_worker(
        "worker-bad-store",
        env={"TORCHFARM_BLOB_URL": "s3://torchfarm?endpoint=http://127.0.0.1:1"},
    )
    farm.worker_names.discard("worker-bad-store")  # the farm's readiness ignores it
    assert proc.wait(timeout=120) != 0
    with open(os.path.join(farm.log_dir, "worker-bad-store.log")) as f:
        assert "blob store s3://torchfarm" in f.read()
    farm.procs.pop("worker-bad-store")
