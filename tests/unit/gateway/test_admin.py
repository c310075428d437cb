"""`torchfarm cache` through the gateway's Admin RPCs (a real gateway on a bare redis-server,
synthetic signed entries): every command with an admin token alone; a tenant's token gets
PERMISSION_DENIED and changes nothing; import admits only entries signed by one of the
gateway's TORCHFARM_VERIFY_KEYS, and never --unsigned."""

import itertools
import json
import time

import grpc
import pytest
import redis
import zstandard
from typer.testing import CliRunner

from tests.unit.cache.test_bundle_trust import _signed_entry
from torchfarm import signing
from torchfarm.cache import admin
from torchfarm.cache import keys as redis_keys
from torchfarm.cache.admin import CacheAdmin
from torchfarm.cache.store import Store
from torchfarm.cli import app
from torchfarm.gateway import auth
from torchfarm.gateway.server import build_server
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc
from torchfarm.settings import GatewaySettings

ALICE, ADMIN = auth.make_token(), auth.make_token()


@pytest.fixture
def farm(redis_url, tmp_path, monkeypatch):
    """(gateway address, store, the signer its TORCHFARM_VERIFY_KEYS names); the CLI's
    environment points at nothing else."""
    for name in ("TORCHFARM_ADDR", "TORCHFARM_ADMIN_TOKEN", "TORCHFARM_VERIFY_KEYS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHFARM_REDIS_URL", "redis://127.0.0.1:1/0")  # never used
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    signer = signing.generate(str(tmp_path / "farm.key"))
    settings = GatewaySettings(
        port=0,
        redis_url=redis_url,
        tenants=f"alice:{auth.hash_token(ALICE)}",
        admins=f"ops:{auth.hash_token(ADMIN)}",
        metrics_port=0,
        threads=8,
        chunk_bytes=100,  # an export of a few entries is many chunks
        verify_keys=signer.public_key,
    )
    store = Store.from_clients(client)
    server, port = build_server(settings, store)
    server.start()
    yield f"127.0.0.1:{port}", store, signer
    server.stop(0)
    client.flushdb()


def _cache(addr: str, token: str, *args: str):
    return CliRunner().invoke(app, ["cache", *args, "--addr", addr, "--token", token])


def _json(addr: str, *args: str):
    result = _cache(addr, ADMIN, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output.splitlines()[-1] if args[0] == "import" else result.output)


def test_every_cache_command_works_with_an_admin_token_alone(farm, tmp_path):
    addr, store, signer = farm
    made = [_signed_entry(store, signer, n) for n in (1, 2, 3)]
    store.artifacts.redis.zadd(redis_keys.RECENT, {made[0]: time.time() - 3 * 86400})

    rows = _json(addr, "ls", "--limit", "0")
    assert {r["key"] for r in rows} == set(made)
    assert all(r["tenant"] == "alice" and "graph_code" not in r for r in rows)
    assert [r["key"] for r in _json(addr, "ls", "--older-than", "2d")] == [made[0]]
    assert len(_json(addr, "ls", "--limit", "2")) == 2
    shown = _json(addr, "show", made[1][:10])
    assert shown["key"] == made[1] and shown["entries"][0]["public_key"] == made[1]
    assert _json(addr, "stats")["entries"] == 3
    table = _cache(addr, ADMIN, "ls")
    assert table.exit_code == 0 and made[2][:16] in table.output

    bundle = tmp_path / "all.tfbundle"
    assert _json(addr, "export", str(bundle))["entries"] == 3
    assert _json(addr, "rm", made[1][:12]) == {"key": made[1], "entries_removed": 1}
    assert _json(addr, "purge", "--older-than", "2d") == {"keys_removed": 1, "entries_removed": 1}
    assert {r["key"] for r in _json(addr, "ls")} == {made[2]}
    imported = _json(addr, "import", str(bundle))
    assert imported["entries"] == 3 and imported["signed_by"] == {signer.public_key: 3}
    (entry,) = store.artifacts.entries(made[1])
    assert entry.signed_by == signer.public_key
    assert _json(addr, "purge", "--all")["keys_removed"] == 3
    assert not store.artifacts.keys()

    store.counters.count("cpu-avx2", compiles=1, gemm_candidates_benchmarked=6)
    assert _json(addr, "stats")["pools"]["cpu-avx2"]["gemm_candidates_benchmarked"] == 6
    assert _json(addr, "drop-kernels", "--pool", "cpu-avx2") == {
        "pool": "cpu-avx2",
        "generation": 1,
    }
    assert store.pools.kernel_generation("cpu-avx2") == 1


def test_a_tenant_token_is_refused_every_command_and_changes_nothing(farm, tmp_path):
    addr, store, signer = farm
    key = _signed_entry(store, signer, 1)
    bundle = tmp_path / "b.tfbundle"
    exported = _cache(addr, ADMIN, "export", str(bundle))
    assert exported.exit_code == 0, (exported.output, exported.exception)
    for command in (
        ["ls"],
        ["show", key],
        ["stats"],
        ["rm", key],
        ["purge", "--all"],
        ["export", str(tmp_path / "x.tfbundle")],
        ["import", str(bundle)],
        ["drop-kernels", "--pool", "cpu"],
    ):
        result = _cache(addr, ALICE, *command)
        assert result.exit_code == 1, (command, result.output)
        assert "PERMISSION_DENIED" in result.output, command
    assert store.artifacts.entries(key) and not (tmp_path / "x.tfbundle").exists()
    assert store.pools.kernel_generation("cpu") == 0
    assert "UNAUTHENTICATED" in _cache(addr, "not-a-token", "stats").output


def test_import_through_the_gateway_admits_only_what_its_verify_keys_signed(farm, tmp_path):
    addr, store, signer = farm
    stranger = signing.generate(str(tmp_path / "stranger.key"))
    ours, theirs = _signed_entry(store, signer, 1), _signed_entry(store, stranger, 2)
    bundle = tmp_path / "mixed.tfbundle"
    assert _cache(addr, ADMIN, "export", str(bundle)).exit_code == 0
    store.artifacts.drop(ours)
    store.artifacts.drop(theirs)

    refused = _cache(addr, ADMIN, "import", str(bundle))
    assert refused.exit_code == 1 and "FAILED_PRECONDITION" in refused.output
    assert "1 of 2 entries are not signed by a trusted key" in refused.output
    assert not store.artifacts.keys()  # nothing imported
    for flag in (["--unsigned"], ["--trust-key", stranger.public_key]):
        result = _cache(addr, ADMIN, "import", str(bundle), *flag)
        assert result.exit_code == 1 and "direct store access" in result.output, flag
    assert not store.artifacts.keys()


def test_admin_rpcs_refuse_bad_requests_with_precise_statuses(farm):
    addr, store, signer = farm
    _signed_entry(store, signer, 1)
    metadata = [("authorization", f"Bearer {ADMIN}")]
    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.AdminStub(channel)
        for call, status in [
            (lambda: stub.Show(pb.ShowRequest(key="f" * 64), metadata=metadata), "NOT_FOUND"),
            (lambda: stub.Show(pb.ShowRequest(key="x"), metadata=metadata), "INVALID_ARGUMENT"),
            (lambda: stub.Purge(pb.PurgeRequest(), metadata=metadata), "INVALID_ARGUMENT"),
            (lambda: stub.List(pb.ListRequest(sort="name"), metadata=metadata), "INVALID_ARGUMENT"),
            (
                lambda: stub.Import(iter([pb.BundleChunk(data=b"junk")]), metadata=metadata),
                "INVALID_ARGUMENT",
            ),
            (  # no such pool: a typo drops nothing
                lambda: stub.DropKernels(pb.DropKernelsRequest(pool="cpu"), metadata=metadata),
                "NOT_FOUND",
            ),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code().name == status
    assert len(store.artifacts.keys()) == 1


def _import(addr: str, chunks) -> grpc.RpcError:
    metadata = [("authorization", f"Bearer {ADMIN}")]
    with grpc.insecure_channel(addr) as channel:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.AdminStub(channel).Import(chunks, metadata=metadata, timeout=300)
    return e.value


def test_an_import_past_the_upload_cap_is_refused_and_nothing_is_stored(farm):
    """Issue 50, item 4: a 600 MB upload (a valid bundle's start, then more) is refused
    RESOURCE_EXHAUSTED once past admin.MAX_BUNDLE_BYTES; bench/import_bound.py measures the
    gateway's memory meanwhile."""
    addr, store, signer = farm
    key = _signed_entry(store, signer, 1)
    bundle = CacheAdmin(store).export(pb.ExportRequest())
    store.artifacts.drop(key)
    step = 1 << 20
    chunks = itertools.chain(
        [pb.BundleChunk(data=bundle)],
        (pb.BundleChunk(data=bytes(step)) for _ in range(600)),  # generated as sent
    )
    refused = _import(addr, chunks)
    assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"over {admin.MAX_BUNDLE_BYTES} bytes; nothing imported" in refused.details()
    assert store.artifacts.keys() == []


def test_a_bundle_that_decodes_past_its_ratio_is_refused_and_nothing_is_stored(farm):
    """A decompression bomb: a valid bundle whose last entry is 64 MiB of zeros, ~4 KB sent
    (the bundle is decoded as a stream, up to MAX_BUNDLE_RATIO bytes per byte sent)."""
    addr, store, signer = farm
    key = _signed_entry(store, signer, 1)
    honest = CacheAdmin(store).export(pb.ExportRequest())
    store.artifacts.drop(key)
    bundle = zstandard.ZstdDecompressor().decompress(honest)
    writer = zstandard.ZstdCompressor(level=3).compressobj()
    padding = pb.BundleEntry(key="0" * 64, artifact=bytes(64 << 20)).SerializeToString()
    field = pb.CacheBundle.DESCRIPTOR.fields_by_name["entries"].number
    tag = bytes([field << 3 | 2]) + _varint(len(padding))
    bomb = writer.compress(bundle) + writer.compress(tag + padding) + writer.flush()
    assert len(bomb) < 100 << 10
    refused = _import(addr, iter([pb.BundleChunk(data=bomb)]))
    assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "decodes to more than" in refused.details()
    assert store.artifacts.keys() == []
    assert _import(addr, iter([pb.BundleChunk(data=b"junk")])).code().name == "INVALID_ARGUMENT"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))
