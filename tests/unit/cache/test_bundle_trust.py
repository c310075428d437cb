"""`torchfarm cache export/import` carry signatures, and import admits only entries a
trusted key signed: a crafted bundle imports nothing; --unsigned imports with a warning;
an importing farm with its own signing key re-signs what it verified."""

import hashlib
import json

import pytest
import redis
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
    return CliRunner().invoke(app, ["cache", "import", *args])


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


def test_a_bundle_carries_signatures_and_imports_only_what_a_trusted_key_signed(
    scratch, tmp_path, monkeypatch
):
    farm = signing.generate(str(tmp_path / "farm.key"))
    keys = [_signed_entry(scratch, farm, 1), _signed_entry(scratch, farm, 2, private_to="bob")]
    bundle = tmp_path / "b.tfbundle"
    assert CliRunner().invoke(app, ["cache", "export", str(bundle)]).exit_code == 0
    for key in keys:
        scratch.artifacts.drop(key)

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


def test_an_entry_from_another_farm_is_re_signed_with_this_farms_key(
    scratch, tmp_path, monkeypatch
):
    theirs = signing.generate(str(tmp_path / "theirs.key"))
    key = _signed_entry(scratch, theirs, 3)
    bundle = tmp_path / "b.tfbundle"
    assert CliRunner().invoke(app, ["cache", "export", str(bundle)]).exit_code == 0
    scratch.artifacts.drop(key)
    ours = signing.generate(str(tmp_path / "ours.key"))
    monkeypatch.setenv("TORCHFARM_SIGNING_KEY", str(tmp_path / "ours.key"))
    done = _import(str(bundle), "--trust-key", theirs.public_key)
    assert done.exit_code == 0, done.output
    assert "re-signed 1 with this farm's key" in done.output
    (entry,) = scratch.artifacts.entries(key)
    assert signing.entry_verifies(signing.Verifier([ours.public_key]), key, entry)


def test_a_crafted_bundle_imports_nothing_unless_unsigned_is_asked_for(
    scratch, tmp_path, monkeypatch
):
    farm = signing.generate(str(tmp_path / "farm.key"))
    genuine = _signed_entry(scratch, farm, 4)
    bundle = tmp_path / "b.tfbundle"
    assert CliRunner().invoke(app, ["cache", "export", str(bundle)]).exit_code == 0
    scratch.artifacts.drop(genuine)
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
