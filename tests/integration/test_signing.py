"""Entries only workers can vouch for: bytes that a Redis writer or a bundle author plants
under a real graph's key are never loaded by a client, which compiles locally instead.

The planted artifact is the real thing an attacker would write: an Artifact whose Inductor
bytes run code when loaded (a pickle in Inductor's own "binary" format), with a correct
sha256, so every integrity check passes. Only the signature can tell it apart.
"""

import json
import os
import pickle
import warnings

import pytest
import torch
import zstandard
from typer.testing import CliRunner

import torchfarm
from tests.integration.helpers import ADMIN_TOKEN, TOKENS, past_gateway_memory
from torchfarm import signing
from torchfarm.cache.artifacts import digest_of
from torchfarm.cache.store import entry_dict
from torchfarm.cli import app
from torchfarm.client import backend, records
from torchfarm.compiler import descriptor, serialize, trace_state
from torchfarm.compiler.inductor import ARTIFACT_FORMAT
from torchfarm.compiler.target import local_target
from torchfarm.contract.cache_key import public_key
from torchfarm.proto import torchfarm_pb2 as pb

pytestmark = pytest.mark.integration


class _Exploit:
    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


def _hostile_artifact(marker: str) -> bytes:
    """An Artifact whose load writes `marker`: the loader unpickles the `inductor` bytes
    (AOTAutograd's bundled entry)."""
    exploit = pickle.dumps(_Exploit(f"open({marker!r}, 'w').write('pwned')"))
    return pb.Artifact(format=ARTIFACT_FORMAT, inductor=exploit).SerializeToString()


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(width)
    return torch.nn.Sequential(torch.nn.Linear(13, width), torch.nn.GELU()).eval()


def _graph_key(model: torch.nn.Module, x: torch.Tensor) -> str:
    """The public key the torchfarm backend computes for the model's graph (no farm call)."""
    keys = []

    def capture(gm, example_inputs):
        options = pb.Options(mode="default", state=trace_state.capture())
        described = descriptor.describe(gm)  # a static graph's key hashes its descriptor
        keys.append(public_key(serialize.dumps(gm), local_target("cpu"), options, described))
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=capture)(x)
    torch._dynamo.reset()
    return keys[0]


def _run(farm, model: torch.nn.Module, x: torch.Tensor) -> list[str]:
    """Compile through the farm in this process; the torchfarm warnings it raised."""
    backend.history.clear()
    records._warned.clear()  # each run stands for a fresh process: one warning each
    compiled = torchfarm.compile(model, addr=farm.addr, token=TOKENS["alice"])
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.testing.assert_close(compiled(x), model(x))
    torch._dynamo.reset()
    return [str(w.message) for w in caught if str(w.message).startswith("torchfarm:")]


def _planted_meta(key: str, data: bytes, signature: bytes) -> pb.EntryMeta:
    """What a Redis writer would store: correct digest and size, any signature it can make."""
    return pb.EntryMeta(
        digest=digest_of(data),
        size=len(data),
        public_key=key,
        signature=signature,
        tenant="mallory",
        mode="default",
        pool="planted",
    )


def test_a_planted_entry_is_never_loaded_unsigned_forged_or_replayed(farm, store, tmp_path):
    x = torch.randn(3, 13)
    # a genuine entry of another graph: its signature is valid, but over other fields
    assert _run(farm, _model(21), x) == [] and backend.history[-1].source == "miss"
    genuine = store.artifacts.entries(backend.history[-1].key)[0]
    assert signing.entry_verifies(signing.Verifier([farm.verify_keys]), genuine.public_key, genuine)

    model = _model(17)
    key = _graph_key(model, x)
    marker = str(tmp_path / "pwned")
    data = _hostile_artifact(marker)
    forger = signing.generate(str(tmp_path / "forger.key"))
    unsigned = _planted_meta(key, data, b"")
    for name, signature in [
        ("unsigned", b""),
        ("forged", signing.sign_entry(forger, key, unsigned)),  # a key the farm does not trust
        ("replayed", genuine.signature),  # the farm's own signature, of another entry
    ]:
        store.artifacts.drop(key)
        store.artifacts.put(key, data, _planted_meta(key, data, signature))
        past_gateway_memory()  # the gateway serves this entry, not the one before
        warned = _run(farm, model, x)
        assert not os.path.exists(marker), name  # the planted bytes never ran
        assert [r.source for r in backend.history] == ["local"], name
        assert len(warned) == 1 and "not signed by the farm" in warned[0], (name, warned)
    store.artifacts.drop(key)
    past_gateway_memory()
    # with the planted entry gone, the farm compiles and signs the graph, and it loads
    assert _run(farm, model, x) == [] and backend.history[-1].source == "miss"


def _bundle(path, key: str, data: bytes, meta: pb.EntryMeta) -> None:
    bundle = pb.CacheBundle(format="torchfarm-bundle-v1")
    bundle.entries.add(
        key=key, digest=meta.digest, meta_json=json.dumps(entry_dict(meta)), artifact=data
    )
    path.write_bytes(zstandard.ZstdCompressor().compress(bundle.SerializeToString()))


def test_a_crafted_bundle_is_refused_and_an_unsigned_import_is_never_loaded(
    farm, store, tmp_path, monkeypatch
):
    monkeypatch.setenv("TORCHFARM_REDIS_URL", farm.redis_url)
    monkeypatch.setenv("TORCHFARM_BLOB_URL", farm.blob_url)
    monkeypatch.setenv("TORCHFARM_VERIFY_KEYS", farm.verify_keys)  # the operator's trust
    x = torch.randn(3, 13)
    model = _model(29)
    key = _graph_key(model, x)
    marker = str(tmp_path / "pwned")
    data = _hostile_artifact(marker)
    meta = _planted_meta(key, data, b"")
    crafted = tmp_path / "crafted.tfbundle"
    _bundle(crafted, key, data, meta)

    for where in (["--addr", farm.addr, "--token", ADMIN_TOKEN], ["--redis", farm.redis_url]):
        refused = CliRunner().invoke(app, ["cache", "import", str(crafted), *where])
        assert refused.exit_code != 0
        assert "not signed by a trusted key" in refused.output, where
        assert "nothing imported" in refused.output, where
    assert not store.artifacts.entries(key)

    imported = CliRunner().invoke(
        app, ["cache", "import", str(crafted), "--redis", farm.redis_url, "--unsigned", "--json"]
    )
    assert imported.exit_code == 0, imported.output
    assert json.loads(imported.stdout.strip().splitlines()[-1])["unsigned"] == 1
    assert [e.digest for e in store.artifacts.entries(key)] == [meta.digest]
    warned = _run(farm, model, x)
    assert not os.path.exists(marker)
    assert [r.source for r in backend.history] == ["local"]
    assert len(warned) == 1 and "not signed by the farm" in warned[0], warned
    store.artifacts.drop(key)


def test_a_compile_child_can_neither_see_nor_read_the_signing_key(farm):
    import grpc

    from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc

    code = f"""
import os
try:
    found = open({farm.signing_key!r}).read()
except OSError as e:
    found = type(e).__name__
raise RuntimeError("key probe: " + found + " env: " + ",".join(sorted(os.environ)))
"""
    request = pb.CompileRequest(graph=pickle.dumps(_Exploit(code)), target=local_target())
    with grpc.insecure_channel(farm.addr) as channel, pytest.raises(grpc.RpcError) as e:
        list(
            pb_grpc.FarmStub(channel).Compile(
                request, metadata=[("authorization", f"Bearer {TOKENS['alice']}")], timeout=300
            )
        )
    details = e.value.details()
    assert "key probe: FileNotFoundError" in details  # the probe ran, in the sandbox
    assert "PRIVATE KEY" not in details and "SIGNING" not in details
