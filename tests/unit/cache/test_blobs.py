"""The blob backends without a farm: the URL that picks one, the object layout, the file
backend's writes, and the cache over it (a missing or corrupted blob dropped with its entry,
nothing of an artifact left in Redis). The S3 backend against a real server:
tests/integration/test_blob_store.py."""

import hashlib
import os

import pytest
import redis

from torchfarm.cache import keys
from torchfarm.cache.artifacts import ArtifactCache, details_name
from torchfarm.cache.blobs import CacheFull, FileBlobs, RedisBlobs, S3Blobs, open_blobs
from torchfarm.proto import torchfarm_pb2 as pb

DIGEST = hashlib.sha256(b"artifact").hexdigest()


def test_the_url_picks_the_backend():
    cache = redis.Redis()  # not connected: no backend talks to a server when it is made
    assert isinstance(open_blobs("redis", cache), RedisBlobs)
    assert open_blobs("file:///var/lib/torchfarm/blobs", cache).root == "/var/lib/torchfarm/blobs"
    s3 = open_blobs("s3://farm/cache/v1?endpoint=http://127.0.0.1:8333&region=eu-west-1", cache)
    assert isinstance(s3, S3Blobs)
    assert (s3.bucket, s3.name(DIGEST)) == (
        "farm",
        f"cache/v1/{keys.FORMAT}/blob/{DIGEST[:2]}/{DIGEST}",
    )
    assert s3.client.meta.endpoint_url == "http://127.0.0.1:8333"
    assert s3.client.meta.region_name == "eu-west-1"
    assert open_blobs("s3://farm", cache).name(DIGEST) == keys.blob_object(DIGEST)


@pytest.mark.parametrize(
    "url",
    ["file://relative/dir", "file://host/dir", "s3://", "s3://farm?endpoint=x&secret=y", "ftp://x"],
)
def test_a_url_of_no_known_form_is_refused_with_the_forms_it_takes(url):
    with pytest.raises(ValueError, match="expected redis, file:///absolute/dir or s3://"):
        open_blobs(url, redis.Redis())


def test_objects_are_versioned_and_fanned_out_by_digest():
    assert keys.blob_object(DIGEST) == f"{keys.FORMAT}/blob/{DIGEST[:2]}/{DIGEST}"


def test_the_file_backend_stores_whole_blobs_and_leaves_no_temporary_files(tmp_path):
    blobs = FileBlobs(str(tmp_path / "blobs"))
    blobs.check()
    assert blobs.get(DIGEST, 1 << 20) is None
    blobs.put(DIGEST, b"first")
    blobs.put(DIGEST, b"second")  # a rewrite replaces it whole
    assert blobs.get(DIGEST, 1 << 20) == b"second"
    files = [
        os.path.relpath(os.path.join(d, f), blobs.root)
        for d, _, fs in os.walk(blobs.root)
        for f in fs
    ]
    assert files == [keys.blob_object(DIGEST)]
    blobs.delete([DIGEST, "0" * 64])  # an absent blob is no error
    assert blobs.get(DIGEST, 1 << 20) is None


def test_the_file_backend_refuses_a_directory_it_cannot_write(tmp_path):
    os.chmod(tmp_path, 0o500)
    try:
        if os.access(tmp_path, os.W_OK):  # root writes anywhere
            pytest.skip("running as root: every directory is writable")
        with pytest.raises(PermissionError, match="not writable"):
            FileBlobs(str(tmp_path)).check()
    finally:
        os.chmod(tmp_path, 0o700)


@pytest.fixture
def cache(redis_url, tmp_path) -> ArtifactCache:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield ArtifactCache(client, FileBlobs(str(tmp_path / "blobs")))
    client.flushdb()


def _bulky_meta() -> pb.EntryMeta:
    """An entry's metadata at the sizes a big graph gives: the longest graph code kept, many
    kernels, key parts and their values."""
    return pb.EntryMeta(
        mode="default",
        graph_code="x = torch.ops.aten.mm(a, b)\n" * 800,  # 22 KB: the workers keep 20,000
        kernels=[pb.Kernel(name=f"cpp_fused_{i}", source_bytes=4000) for i in range(300)],
        op_counts={f"aten.op{i}": i for i in range(100)},
        key_parts={f"part{i}": hashlib.sha256(bytes(i)).hexdigest() for i in range(20)},
        key_values={f"part{i}": f"value {i}" for i in range(20)},
        signature=os.urandom(64),
        public_key="p" * 64,
    )


def test_an_artifact_and_its_details_live_in_the_blob_store_and_redis_only_its_index(cache):
    data = os.urandom(3 << 20)  # incompressible: 3 MB stored
    entry = cache.put("k" * 64, data, _bulky_meta())
    cache.record_hit("k" * 64, entry.digest)
    assert cache.read("k" * 64, entry) == data
    assert cache.blobs.get(entry.digest, 1 << 30) is not None
    assert not list(cache.redis.scan_iter(match=keys.BLOB_PATTERN))
    held = sum(cache.redis.memory_usage(k) for k in cache.redis.scan_iter())
    assert held <= 4096, held  # the index, usage, LRU order and totals of one entry
    [indexed] = cache.entries("k" * 64)
    assert not indexed.graph_code and not indexed.kernels  # details stay out of Redis
    assert indexed.key_parts == entry.key_parts and indexed.signature == entry.signature
    full = cache.with_details(indexed)
    assert full.graph_code == entry.graph_code and list(full.kernels) == list(entry.kernels)
    cache.drop("k" * 64)
    assert os.listdir(cache.blobs.root) == [keys.FORMAT]
    assert [f for _, _, fs in os.walk(cache.blobs.root) for f in fs] == []  # no orphan


@pytest.mark.parametrize("fault", ["missing", "corrupted"])
def test_a_missing_or_corrupted_blob_reads_as_a_miss_and_its_entry_is_dropped(cache, fault):
    entry = cache.put("k" * 64, b"x" * 5000, _bulky_meta())
    if fault == "missing":
        cache.blobs.delete([entry.digest])
    else:
        cache.blobs.put(entry.digest, cache.codec.encode(b"y" * 5000))
    assert cache.stored("k" * 64, entry) is None
    assert cache.entries("k" * 64) == [] and cache.keys() == []
    assert cache.blobs.get(entry.digest, 1 << 30) is None  # the bad blob went with its entry
    assert cache.blobs.get(details_name(entry.digest), 1 << 30) is None  # and its details
    assert cache.totals() == {"stored_bytes": 0.0, "entries": 0.0}


def test_a_full_redis_keeps_nothing_and_leaves_no_object_behind(cache):
    used = cache.redis.info("memory")["used_memory"]
    cache.redis.config_set("maxmemory-policy", "noeviction")
    cache.redis.config_set("maxmemory", used // 2)
    try:
        with pytest.raises(CacheFull):
            cache.put("k" * 64, b"x" * 5000, _bulky_meta())
    finally:
        cache.redis.config_set("maxmemory", 0)
    assert cache.keys() == []
    assert [f for _, _, fs in os.walk(cache.blobs.root) for f in fs] == []


def test_a_process_pointed_at_another_blob_store_refuses_to_run(cache, redis_url, monkeypatch):
    from typer.testing import CliRunner

    from torchfarm.cli import app

    cache.record_store()  # a worker's, at start
    cache.check_store()
    monkeypatch.setenv("TORCHFARM_REDIS_URL", redis_url)
    monkeypatch.setenv("TORCHFARM_BLOB_URL", "redis")
    result = CliRunner().invoke(app, ["cache", "ls", "--direct"])
    assert result.exit_code == 2
    assert f"blobs live in {cache.blobs.where}" in result.output
    monkeypatch.setenv("TORCHFARM_BLOB_URL", f"file://{cache.blobs.root}")
    assert CliRunner().invoke(app, ["cache", "ls", "--direct"]).exit_code == 0
