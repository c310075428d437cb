"""Issue 50, item 1: whoever writes the cache's Redis (or the blob store) plants index
entries and files, and no reader, dropper, evictor or exporter of the cache touches a file or
object outside the store, reads past an entry's recorded size, or waits on a FIFO. Each bad
entry is dropped, counted (`bad_entries` in `cache stats`) and the ask is a miss; an honest
entry beside it is still served. Against a real redis-server, for the directory store and a
real S3 server (SeaweedFS's `weed`: the `s3` fixture of tests/unit/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import stat
import threading

import pytest
import redis
import zstandard

from torchfarm.cache import keys
from torchfarm.cache.admin import CacheAdmin
from torchfarm.cache.artifacts import details_name, digest_of, index_value
from torchfarm.cache.blobs import FileBlobs, S3Blobs
from torchfarm.cache.store import Store
from torchfarm.gateway.coordinator import Coordinator
from torchfarm.proto import torchfarm_pb2 as pb

KEY = "a" * 64  # the planted entries' key
HONEST_KEY = "b" * 64
VICTIM = b"a host file that no planted entry may read or remove\n"
PREFIX = "farm"
HONEST = b"an honest artifact" * 100


@pytest.fixture
def client(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.flushdb()


def _path(store: Store, name: str) -> str:
    """Where the directory store keeps blob `name`."""
    return os.path.join(store.artifacts.blobs.root, keys.blob_object(name))


def _plant(store: Store, field: str, digest: str, stored_bytes: int = 64) -> None:
    """An index entry as a Redis writer writes it: under `field`, naming `digest`."""
    meta = pb.EntryMeta(digest=digest, size=stored_bytes, stored_bytes=stored_bytes, created=1)
    store.artifacts.redis.hset(keys.index(KEY), field, index_value(meta.SerializeToString()))
    store.artifacts.redis.zadd(keys.RECENT, {KEY: 1})


def _served_after(store: Store) -> bool:
    """Every path that reads or removes entries, run over the planted ones: a tenant's Get
    (a miss), `cache show`, `ls`, `export`, `stats`, `purge`; and the honest entry of
    another key is still served afterwards."""
    coordinator = Coordinator(store, enqueue=None, compile_timeout_s=60)
    assert coordinator.get(pb.Ask(key=KEY), "alice", "rid") is None
    admin = CacheAdmin(store)
    admin.ls(pb.ListRequest())
    admin.export(pb.ExportRequest())
    served = coordinator.get(pb.Ask(key=HONEST_KEY), "alice", "rid")
    return served is not None and served.stored is not None


def _planted_names(outside: str, store_root: str) -> dict[str, str]:
    """The re-probe's bad names: a traversal to `outside` from where the old code joined a
    digest (`<root>/tf6/blob/<digest[:2]>/<digest>`: `..` as the fan-out directory), an
    absolute path, and /dev/zero by traversal."""
    base = os.path.join(store_root, keys.FORMAT)  # <root>/tf6/blob/.. is <root>/tf6
    return {
        "traversal": os.path.relpath(outside, base),
        "absolute": outside,
        "dev zero": os.path.relpath("/dev/zero", base),
    }


@pytest.mark.parametrize("kind", ["traversal", "absolute", "dev zero"])
def test_a_bad_digest_never_becomes_a_path(client, tmp_path, kind):
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    (tmp_path / "victim.details").write_bytes(VICTIM)
    root = str(tmp_path / "blobs")
    store = Store.from_clients(client, blobs=FileBlobs(root))
    store.artifacts.put(HONEST_KEY, HONEST, pb.EntryMeta())
    name = _planted_names(str(victim), root)[kind]
    _plant(store, name, name)  # field and digest alike: the entry the old code unlinked
    _plant(store, keys.blob_name(digest_of(b"x")), name)  # a good field naming a bad digest
    unbounded = digest_of(b"y")  # a good name whose read would have no bound
    _plant(store, unbounded, unbounded, stored_bytes=-1)
    os.makedirs(os.path.dirname(_path(store, unbounded)), exist_ok=True)
    with open(_path(store, unbounded), "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB that reads as zeros
    assert _served_after(store)
    assert victim.read_bytes() == VICTIM and (tmp_path / "victim.details").read_bytes() == VICTIM
    assert store.artifacts.entries(KEY) == []
    assert client.hlen(keys.index(KEY)) == 0  # dropped as read
    assert store.summary()["bad_entries"] == 3
    with pytest.raises(keys.BadBlobName):
        store.artifacts.blobs.get(name, 64)  # the one function refuses it, whoever asks


def _valid_entry(store: Store) -> pb.EntryMeta:
    """A real entry of KEY whose blob the test then replaces: in a fan-out directory of its
    own (not the honest entry's), which one test replaces whole."""
    data = os.urandom(4096)
    while digest_of(data)[:2] == digest_of(HONEST)[:2]:
        data = os.urandom(4096)
    return store.artifacts.put(KEY, data, pb.EntryMeta())


def _replace(path: str, kind: str, victim: str) -> None:
    os.unlink(path)
    if kind == "symlink":
        os.symlink(victim, path)
    elif kind == "symlink to /dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
    elif kind == "oversized":
        with open(path, "wb") as f:
            f.truncate(1 << 30)  # sparse: 1 GiB that reads as zeros


@pytest.mark.parametrize(
    "kind", ["symlink", "symlink to /dev/zero", "fifo", "device", "oversized", "linked directory"]
)
def test_a_planted_file_at_a_good_name_is_never_followed_waited_on_or_read_past_its_size(
    client, tmp_path, kind
):
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("mknod needs root (CI runs the attack tests as root)")
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    root = str(tmp_path / "blobs")
    store = Store.from_clients(client, blobs=FileBlobs(root))
    store.artifacts.put(HONEST_KEY, HONEST, pb.EntryMeta())
    entry = _valid_entry(store)
    path = _path(store, entry.digest)
    details = _path(store, details_name(entry.digest))
    outside = tmp_path / "outside"
    if kind == "linked directory":  # the fan-out directory is a link to another one
        outside.mkdir()
        (outside / os.path.basename(path)).write_bytes(VICTIM)
        fan_out = os.path.dirname(path)
        for name in os.listdir(fan_out):
            os.unlink(os.path.join(fan_out, name))
        os.rmdir(fan_out)
        os.symlink(outside, fan_out)
    else:
        _replace(path, kind, str(victim))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(details)
        os.symlink(str(victim), details)  # `cache show` reads the details through it
    ended = threading.Event()

    def every_path() -> None:
        CacheAdmin(store).show(pb.ShowRequest(key=KEY[:8]))
        assert _served_after(store)
        ended.set()

    reader = threading.Thread(target=every_path, daemon=True)
    reader.start()
    reader.join(120)  # a FIFO opened for reading without O_NONBLOCK would wait here forever
    assert ended.is_set(), "a read waited on a planted file (or failed: see the test's log)"
    assert victim.read_bytes() == VICTIM
    if kind == "linked directory":
        assert (outside / os.path.basename(path)).read_bytes() == VICTIM
    else:
        assert not os.path.lexists(path) and not os.path.lexists(details)  # the links went
    assert store.artifacts.entries(KEY) == []  # dropped: a miss, rebuilt on the next compile


def test_a_read_of_the_s3_store_stops_at_the_recorded_size_and_bad_names_reach_no_object(
    client, s3
):
    blobs = S3Blobs("torchfarm", PREFIX, s3.endpoint, "us-east-1")
    blobs.check()
    store = Store.from_clients(client, blobs=blobs)
    store.artifacts.put(HONEST_KEY, HONEST, pb.EntryMeta())
    victim = "victim"  # an object of the bucket outside the farm's prefix
    s3.client().put_object(Bucket="torchfarm", Key=victim, Body=VICTIM)
    s3.client().put_object(Bucket="torchfarm", Key=f"{victim}.details", Body=VICTIM)
    for name in (f"../../../../../{victim}", f"/{victim}", "../../../../../../dev/zero"):
        _plant(store, name, name)
    entry = _valid_entry(store)
    oversized = zstandard.ZstdCompressor().compress(bytes(64 << 20))  # inflates past any size
    s3.client().put_object(
        Bucket="torchfarm", Key=blobs.name(entry.digest), Body=oversized + bytes(1 << 20)
    )
    assert blobs.get(entry.digest, entry.stored_bytes) is None  # read: stored_bytes + 1
    assert _served_after(store)
    objects = s3.objects()
    assert victim in objects and f"{victim}.details" in objects
    assert s3.client().get_object(Bucket="torchfarm", Key=victim)["Body"].read() == VICTIM
    assert store.artifacts.entries(KEY) == [] and store.summary()["bad_entries"] == 3
    assert blobs.name(entry.digest) not in objects  # the oversized object went with its entry


def test_eviction_and_cache_rm_drop_planted_entries_without_touching_host_files(client, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    root = str(tmp_path / "blobs")
    store = Store.from_clients(client, blobs=FileBlobs(root))
    for name in _planted_names(str(victim), root).values():
        _plant(store, name, name)
    assert store.artifacts.evict(max_bytes=0, ttl_s=1, now=10) == [KEY]
    assert victim.read_bytes() == VICTIM and store.artifacts.keys() == []
    for name in _planted_names(str(victim), root).values():
        _plant(store, name, name)
    assert CacheAdmin(store).drop(pb.DropRequest(key=KEY)).entries == 3  # `cache rm`
    assert victim.read_bytes() == VICTIM
    assert store.summary()["bad_entries"] == 6
    assert store.artifacts.totals().get("stored_bytes", 0) == 0  # never counted, never taken
