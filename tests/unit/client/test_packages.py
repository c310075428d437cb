"""client/packages.py without a farm: the HMAC over a package, its key (a secret of the
client's, never the token alone), and the package's key."""

import hashlib
import hmac
import os
import stat

import pytest
import torch

from torchfarm.client.packages import (
    FORMAT,
    key_file,
    mac_key,
    package_key,
    package_secret,
    seal,
    unseal,
)
from torchfarm.settings import ClientSettings

SECRET = b"0123456789abcdef" * 4


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def test_a_sealed_package_opens_only_with_its_tenants_key():
    alice, bob = mac_key(SECRET, "alice-token"), mac_key(SECRET, "bob-token")
    sealed = seal(alice, b"package")
    assert unseal(alice, sealed) == b"package"
    assert unseal(bob, sealed) is None
    assert unseal(mac_key(b"another machine's secret" * 2, "alice-token"), sealed) is None
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    assert unseal(alice, tampered) is None
    assert unseal(alice, b"short") is None


def test_whoever_saw_the_token_cannot_seal_a_package_the_client_opens():
    """Finding 5 of issue 27: the MAC key was HMAC(token, FORMAT); the gateway sees the token
    on every call (in plaintext without TLS), so it could make the client unpickle anything."""
    token = "alice-token"
    mine = mac_key(package_secret(ClientSettings(token=token)), token)
    for guess in (
        hmac.new(token.encode(), FORMAT, hashlib.sha256).digest(),  # the old key
        hashlib.sha256(token.encode()).digest(),  # what the farm stores
        token.encode(),
    ):
        assert unseal(mine, seal(guess, b"a pickle that runs code")) is None


def test_the_key_file_is_made_once_0600_and_reused(cache_dir):
    first = package_secret(ClientSettings())
    path = key_file()
    assert path.parent == cache_dir / "torchfarm"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(first) == 64 and package_secret(ClientSettings()) == first
    assert os.listdir(path.parent) == ["package.key"]  # nothing left aside


def test_a_key_file_others_can_read_is_refused():
    package_secret(ClientSettings())
    key_file().chmod(0o644)
    with pytest.raises(PermissionError, match="mode 0600"):
        package_secret(ClientSettings())


def test_the_variable_is_the_secret_where_set_and_must_be_long():
    shared = "s" * 40  # e.g. the key file's content, given to every rank of a job
    assert package_secret(ClientSettings(package_key=shared)) == shared.encode()
    assert not key_file().exists()
    with pytest.raises(ValueError, match="TORCHFARM_PACKAGE_KEY"):
        package_secret(ClientSettings(package_key="short"))


def test_the_key_names_tenant_secret_model_config_and_options():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    alice = mac_key(SECRET, "alice")
    key = package_key(alice, model, {"mode": "default"})
    assert key == package_key(alice, model, {"mode": "default"})
    assert key != package_key(mac_key(SECRET, "bob"), model, {"mode": "default"})
    assert key != package_key(mac_key(SECRET[::-1], "alice"), model, {"mode": "default"})
    assert key != package_key(alice, model, {"mode": "max-autotune"})
    assert key != package_key(alice, torch.nn.Linear(4, 5), {"mode": "default"})
    assert key != package_key(alice, model.half(), {"mode": "default"})


def _skipped(x):
    return x + 1


@pytest.fixture
def farm_packages(monkeypatch):
    """The gateway's package calls over a dict (the real ones: tests/integration)."""
    from torchfarm.client import packages
    from torchfarm.proto import torchfarm_pb2 as pb

    store: dict[str, bytes] = {}

    def call(settings, method, request):
        if method == "GetPackage":
            return pb.GetPackageReply(found=request.key in store, package=store.get(request.key))
        store[request.key] = request.package
        return pb.PutPackageReply()

    monkeypatch.setattr(packages, "_call", call)
    return store


def _failing_dumps(monkeypatch):
    from torchfarm.torch_adapter.trace import dynamo_package

    def dumps(package):
        raise TypeError("cannot pickle 'ScriptFunction' object")

    monkeypatch.setattr(dynamo_package, "dumps", dumps)


def test_a_package_no_process_can_save_is_tried_once(farm_packages, monkeypatch):
    """A package that cannot be saved (bert's on 2.11 until 35c52b9: every process recorded,
    failed and paid the attempt): the first process leaves the reason on the farm; the next
    compiles without the skip (the decorator catches PackageLeftOut)."""
    from torchfarm.client.packages import PackageLeftOut, Skipper

    settings = ClientSettings(token="alice-token", package_key=SECRET.decode())
    _failing_dumps(monkeypatch)
    first = Skipper(_skipped, settings, {})
    assert not first.restored and not farm_packages
    first.after_first_call()
    assert len(farm_packages) == 1
    with pytest.raises(PackageLeftOut, match="ScriptFunction"):
        Skipper(_skipped, settings, {})


def test_a_package_without_a_graph_is_left_out(farm_packages, monkeypatch):
    """chatglm's encoder (H200, 2026-11-29): its one graph's frame calls a ScriptFunction and
    is left out, so the package held no graph; each later process restored it, traced that
    frame anyway and paid the restore and a save attempt (skip hit 1.09x PyTorch's warm
    start against 0.97x for a hit without the skip). Later processes now skip the skip."""
    from torchfarm.client.packages import PackageLeftOut, Skipper
    from torchfarm.torch_adapter.trace import dynamo_package

    settings = ClientSettings(token="alice-token", package_key=SECRET.decode())
    monkeypatch.setattr(dynamo_package, "dumps", lambda package: b"frames without graphs")
    monkeypatch.setattr(dynamo_package, "backend_ids", lambda dynamo: set())
    Skipper(_skipped, settings, {}).after_first_call()
    with pytest.raises(PackageLeftOut, match="no frame with a graph"):
        Skipper(_skipped, settings, {})


def test_a_failed_save_never_overwrites_what_the_farm_may_hold(farm_packages, monkeypatch):
    """Where the farm's answer was unknown (a failed call, a package that failed its HMAC),
    a process that cannot save leaves nothing: another process's package may be there."""
    from torchfarm.client import packages
    from torchfarm.errors import FarmError

    farm = packages._call

    def get_fails(settings, method, request):
        if method == "GetPackage":
            raise FarmError("UNAVAILABLE: no gateway answered")
        return farm(settings, method, request)

    monkeypatch.setattr(packages, "_call", get_fails)
    settings = ClientSettings(token="alice-token", package_key=SECRET.decode())
    _failing_dumps(monkeypatch)
    packages.Skipper(_skipped, settings, {}).after_first_call()
    assert not farm_packages
