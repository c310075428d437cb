"""client/packages.py without a farm: the HMAC over a package and the package's key."""

import hashlib

import torch

from torchfarm.client.packages import mac_key, package_key, seal, unseal


def test_a_sealed_package_opens_only_with_its_tenants_key():
    alice, bob = mac_key("alice-token"), mac_key("bob-token")
    sealed = seal(alice, b"package")
    assert unseal(alice, sealed) == b"package"
    assert unseal(bob, sealed) is None
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    assert unseal(alice, tampered) is None
    assert unseal(alice, b"short") is None


def test_the_mac_key_is_not_what_the_farm_stores():
    assert mac_key("t").hex() != hashlib.sha256(b"t").hexdigest()


def test_the_key_names_tenant_model_config_and_options():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    key = package_key("alice", model, {"mode": "default"})
    assert key == package_key("alice", model, {"mode": "default"})
    assert key != package_key("bob", model, {"mode": "default"})
    assert key != package_key("alice", model, {"mode": "max-autotune"})
    assert key != package_key("alice", torch.nn.Linear(4, 5), {"mode": "default"})
    assert key != package_key("alice", model.half(), {"mode": "default"})
