"""`torchfarm cache export/import` carry signatures, and import admits only entries a
trusted key signed: a crafted bundle imports nothing; --unsigned imports with a warning;
imported entries keep the signature they came with and record its key (issue 27: they used
to be re-signed with the importing farm's key, leaving no trace of their origin); entries
private to a tenant are dropped. A pool's tuning builds travel unsigned: the importing pool
builds them itself."""

import hashlib
import json

import pytest
import redis
import zstandard
from typer.testing import CliRunner

from torchfarm import signing
from torchfarm.cache.store import Store
from torchfarm.cli import app
from torchfarm.contract.cache_key import private_key
from torchfarm.proto import torchfarm_pb2 as pb


@pytest.fixture
def scratch(redis_url, monkeypatch) -> Store:
    monkeypatch.setenv("TORCHFARM_REDIS_URL", redis_url)
    monkeypatch.delenv("TORCHFARM_VERIFY_KEYS", raising=False)
    monkeypatch.delenv("TORCHFARM_SIGNING_KEY", raising=False)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield Store.from_clients(client)
    client.flushdb()


def _import(*args: str):
    return CliRunner().invoke(app, ["cache", "import", "--direct", *args])


def _at_most(n: int) -> pb.ShapeGuards:
    """The guards `t0 <= n`."""
    bound = pb.GuardApply(
        op=pb.GuardApply.LE, args=[pb.GuardExpr(input=0), pb.GuardExpr(constant=n)]
    )
    return pb.ShapeGuards(all=[pb.GuardExpr(apply=bound)])


def _signed_entry(store: Store, signer, n: int, private_to: str = "") -> str:
    graph_key = hashlib.sha256(f"graph{n}".encode()).hexdigest()
    data = pb.Artifact(format=2, guards=_at_most(n)).SerializeToString()
    meta = pb.EntryMeta(
        digest=hashlib.sha256(data).hexdigest(),
        size=len(data),
        guards=_at_most(n),
        public_key=graph_key,
        tenant=private_to or "alice",
        private=bool(private_to),
    )
    meta.signature = signing.sign_entry(signer, graph_key, meta)
    key = private_key(graph_key, private_to) if private_to else graph_key
    store.artifacts.put(key, data, meta)
    return key


def _export_and_drop(store: Store, path, keys: list[str]) -> None:
    assert CliRunner().invoke(app, ["cache", "export", "--direct", str(path)]).exit_code == 0
    for key in keys:
        store.artifacts.drop(key)


def test_a_bundle_carries_signatures_and_imports_only_what_a_trusted_key_signed(
    scratch, tmp_path, monkeypatch
):
    farm = signing.generate(str(tmp_path / "farm.key"))
    keys = [_signed_entry(scratch, farm, 1), _signed_entry(scratch, farm, 2)]
    bundle = tmp_path / "b.tfbundle"
    _export_and_drop(scratch, bundle, keys)

    refused = _import(str(bundle))  # no trusted key at all
    assert refused.exit_code != 0 and "nothing imported" in refused.output
    assert "2 of 2 entries are not signed" in refused.output
    other = signing.generate(str(tmp_path / "other.key"))
    assert _import(str(bundle), "--trust-key", other.public_key).exit_code != 0
    assert not any(scratch.artifacts.entries(k) for k in keys)

    monkeypatch.setenv("TORCHFARM_VERIFY_KEYS", farm.public_key)  # the default trust
    done = _import(str(bundle))
    assert done.exit_code == 0, done.output
    assert done.output.strip() == "imported 2 entries"
    for key in keys:
        (entry,) = scratch.artifacts.entries(key)
        assert signing.entry_verifies(signing.Verifier([farm.public_key]), entry.public_key, entry)


def test_an_entry_from_another_farm_keeps_its_origins_signature(scratch, tmp_path, monkeypatch):
    """Finding 5 of issue 27: `--trust-key` entries were re-signed with this farm's key, so
    every client of this farm trusted whatever the operator once trusted, with no trace."""
    theirs = signing.generate(str(tmp_path / "theirs.key"))
    key = _signed_entry(scratch, theirs, 3)
    bundle = tmp_path / "b.tfbundle"
    _export_and_drop(scratch, bundle, [key])
    ours = signing.generate(str(tmp_path / "ours.key"))
    monkeypatch.setenv("TORCHFARM_SIGNING_KEY", str(tmp_path / "ours.key"))
    monkeypatch.setenv("TORCHFARM_VERIFY_KEYS", ours.public_key)  # what the gateway serves
    done = _import(str(bundle), "--trust-key", theirs.public_key)
    assert done.exit_code == 0, done.output
    assert done.output.splitlines()[-1] == "imported 1 entries"
    assert f"signed by {theirs.public_key} only once that key is among" in done.output
    (entry,) = scratch.artifacts.entries(key)
    assert not signing.entry_verifies(signing.Verifier([ours.public_key]), key, entry)
    assert signing.entry_verifies(signing.Verifier([theirs.public_key]), key, entry)
    assert entry.signed_by == theirs.public_key and entry.imported > 0


def test_entries_private_to_a_tenant_are_dropped_and_counted(scratch, tmp_path, monkeypatch):
    """Finding 5 of issue 27: a bundle could place entries in any tenant's private namespace
    (a private entry's key derives from the graph's and the tenant's name, both in the
    bundle), which that tenant's client then preferred."""
    farm = signing.generate(str(tmp_path / "farm.key"))
    shared = _signed_entry(scratch, farm, 5)
    private = [_signed_entry(scratch, farm, n, private_to="alice") for n in (6, 7)]
    bundle = tmp_path / "b.tfbundle"
    _export_and_drop(scratch, bundle, [shared, *private])
    monkeypatch.setenv("TORCHFARM_VERIFY_KEYS", farm.public_key)
    done = _import(str(bundle), "--json")
    assert done.exit_code == 0, done.output
    result = json.loads(done.output.splitlines()[-1])
    assert result["entries"] == 1 and result["private_dropped"] == 2
    assert result["signed_by"] == {farm.public_key: 1}
    assert scratch.artifacts.entries(shared)
    assert not any(scratch.artifacts.entries(k) for k in private)


def test_a_crafted_bundle_imports_nothing_unless_unsigned_is_asked_for(
    scratch, tmp_path, monkeypatch
):
    farm = signing.generate(str(tmp_path / "farm.key"))
    genuine = _signed_entry(scratch, farm, 4)
    bundle = tmp_path / "b.tfbundle"
    _export_and_drop(scratch, bundle, [genuine])
    # the author of the bundle re-labels the genuine, signed artifact for a public model's key
    raw = pb.CacheBundle()
    import zstandard

    raw.ParseFromString(zstandard.ZstdDecompressor().decompress(bundle.read_bytes()))
    victim = hashlib.sha256(b"a public model").hexdigest()
    forged = raw.entries.add()
    forged.CopyFrom(raw.entries[0])
    forged.key = victim
    meta = json.loads(forged.meta_json)
    meta["public_key"] = victim
    forged.meta_json = json.dumps(meta)
    bundle.write_bytes(zstandard.ZstdCompressor().compress(raw.SerializeToString()))

    monkeypatch.setenv("TORCHFARM_VERIFY_KEYS", farm.public_key)
    refused = _import(str(bundle))
    assert refused.exit_code != 0
    assert f"1 of 2 entries are not signed by a trusted key (first: {victim[:16]})" in (
        refused.output.replace("\n", " ")
    )
    assert not scratch.artifacts.entries(genuine) and not scratch.artifacts.entries(victim)

    done = _import(str(bundle), "--unsigned")
    assert done.exit_code == 0, done.output
    assert "WARNING" in done.output and "imported 2 entries (1 unsigned)" in done.output
    (planted,) = scratch.artifacts.entries(victim)
    assert not signing.entry_verifies(signing.Verifier([farm.public_key]), victim, planted)


def test_a_bundle_that_is_no_protobuf_gets_a_precise_refusal(scratch, tmp_path):
    import zstandard

    bundle = tmp_path / "garbage.tfbundle"
    bundle.write_bytes(zstandard.ZstdCompressor().compress(b"\xff" * 64))
    refused = _import(str(bundle))
    assert refused.exit_code == 2 and "not a torchfarm bundle" in refused.output


def test_a_pools_tuning_builds_travel_unsigned_and_are_dropped_with_its_kernels(
    scratch, tmp_path, redis_url, monkeypatch
):
    """What a pool kept tuning of travels as the builds' inputs, which the importing pool's
    builder checks and builds itself: no signature is needed, and nothing else is taken."""
    monkeypatch.setenv("TORCHFARM_BROKER_URL", redis_url)  # the pools' server: scratch's
    operand = pb.GemmInput(dtype="torch.float32", size=[64, 64], stride=[64, 1])
    gemm = pb.KernelBuild(gemm=pb.GemmProblem(op="mm", inputs=[operand] * 2, precision="high"))
    triton = pb.KernelBuild(triton=pb.TritonSource(kernel_name="k", module="m", result=b"{}"))
    cpp = pb.KernelBuild(cpp=pb.KernelSource(code_cache="CppCodeCache", main_code="int x;"))
    assert scratch.pools.add_tuning("cpu", [gemm, triton, cpp, gemm]) == 2  # C++: no tuning
    bundle = tmp_path / "b.tfbundle"
    exported = CliRunner().invoke(app, ["cache", "export", "--direct", "--json", str(bundle)])
    assert json.loads(exported.output)["tuning_builds"] == 2
    assert scratch.pools.drop_kernels("cpu") == 1
    assert scratch.pools.tuning("cpu") == []

    reply = json.loads(_import(str(bundle), "--json").output)  # no trusted key needed
    assert reply["tuning_builds"] == 2 and reply["entries"] == 0
    wanted = sorted(b.SerializeToString(deterministic=True) for b in (gemm, triton))
    got = sorted(b.SerializeToString(deterministic=True) for b in scratch.pools.tuning("cpu"))
    assert got == wanted
    forged = pb.CacheBundle(format="torchfarm-bundle-v1")
    forged.pool_tuning.add(pool="gpu", builds=[cpp])
    path = tmp_path / "forged.tfbundle"
    path.write_bytes(zstandard.ZstdCompressor().compress(forged.SerializeToString()))
    assert json.loads(_import(str(path), "--json").output)["tuning_builds"] == 0
    assert scratch.pools.tuning("gpu") == []
