"""Skipping Dynamo's tracing on a hit (issue 19 item 4): a fresh process that finds its Dynamo
package on the farm runs the step with no frame traced and the farm's graphs, equal to eager;
packages that fail their HMAC (tampered, another tenant's, or sealed by whoever saw the
token) are ignored; inputs that fail the saved guards are traced and compiled as before.
`torch.compile(m, backend="torchfarm")` skips as `torchfarm.compile(m)` does (issue 49 item 4)."""

import hashlib
import hmac
import os
import pickle
import tempfile

import pytest

from tests.integration.helpers import TOKENS, run_client
from torchfarm.cache import keys
from torchfarm.client.packages import FORMAT, seal

PACKAGES = f"{keys.FORMAT}:package:*"  # every tenant's packages, under the current key format
USER_CACHE = tempfile.mkdtemp()  # the clients' package key file (one user, one machine)


def step(farm, *args: str, tenant: str = "alice") -> dict:
    env = {"TORCHFARM_SKIP_TRACING": "1", "XDG_CACHE_HOME": USER_CACHE}
    result = run_client(farm, "skip_client.py", *args, tenant=tenant, env=env)
    assert result["out_err"] < 1e-4 and result["grad_err"] < 1e-4, result
    return result


@pytest.mark.parametrize(
    "model, graphs, again",
    [("blocks", 1, "16"), ("broken", 2, "16"), ("dynamic", 1, "24")],
)
def test_a_fresh_process_skips_tracing(farm, model, graphs, again):
    first = step(farm, model)
    assert first["traced_graphs"] == graphs
    assert set(first["sources"]) <= {"hit", "miss", "merged"}
    # dynamic: another sequence length passes the saved guards (a dynamic dimension)
    second = step(farm, model, again)
    assert second["traced_graphs"] == 0, second
    assert second["sources"] == ["hit"] * graphs


@pytest.mark.parametrize("model, graphs", [("blocks", 1), ("broken", 2)])
def test_torch_compile_with_the_named_backend_skips_tracing(farm, model, graphs):
    # its package key names the entry point: not the one torchfarm.compile's tests saved
    first = step(farm, model, "16", "torch")
    assert first["traced_graphs"] == graphs
    assert set(first["sources"]) <= {"hit", "miss", "merged"}
    second = step(farm, model, "16", "torch")
    assert second["traced_graphs"] == 0, second
    assert second["sources"] == ["hit"] * graphs


@pytest.mark.parametrize(
    "model, size",
    [
        ("broken", "12"),  # another static batch size: Dynamo's own guards fail
        ("dynamic", "5000"),  # fails the guard Inductor's C++ code added (s0 <= 4096)
    ],
)
def test_inputs_that_fail_the_guards_are_traced(farm, model, size):
    step(farm, model)
    changed = step(farm, model, size)
    assert changed["traced_graphs"] >= 1


def test_a_tampered_package_is_ignored(farm, store):
    step(farm, "broken")
    redis = store.artifacts.redis
    for key in redis.keys(PACKAGES):
        value = redis.get(key)
        redis.set(key, value[:-1] + bytes([value[-1] ^ 1]))
    result = step(farm, "broken")
    assert result["traced_graphs"] == 2


def test_another_tenants_package_is_ignored(farm, store):
    redis = store.artifacts.redis
    step(farm, "broken")
    alices = set(redis.keys(PACKAGES))
    step(farm, "broken", tenant="bob")
    (bobs,) = set(redis.keys(PACKAGES)) - alices
    for key in alices:  # one of alice's packages, planted under bob's key
        redis.set(bobs, redis.get(key))
        result = step(farm, "broken", tenant="bob")
        assert result["traced_graphs"] == 2
        break


class _Forged:
    """A package body that runs code when unpickled: it makes a directory."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_package_sealed_by_whoever_saw_the_token_is_never_unpickled(farm, store, tmp_path):
    """Finding 5 of issue 27: the MAC key derived from the token alone, which the gateway sees
    on every call (and the network, without TLS): the gateway could answer GetPackage with a
    pickle of its choice, sealed with that key, and the client ran it."""
    step(farm, "broken")
    marker = str(tmp_path / "ran")
    token_key = hmac.new(TOKENS["alice"].encode(), FORMAT, hashlib.sha256).digest()
    forged = seal(token_key, pickle.dumps(_Forged(marker)))
    redis = store.artifacts.redis
    for key in redis.keys(PACKAGES):
        redis.set(key, forged)
    result = step(farm, "broken")
    assert not os.path.exists(marker)
    assert result["traced_graphs"] == 2
