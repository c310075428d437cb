"""TORCHFARM_TENANT_MAX_COMPILES: a tenant that already waits on its limit of compiles gets
RESOURCE_EXHAUSTED for one more; other tenants, and hits, are not affected."""

import concurrent.futures
import dataclasses
import time

import pytest
import torch

from tests.integration.helpers import TOKENS, direct_request
from torchfarm.cache import keys
from torchfarm.client import remote
from torchfarm.gateway.auth import hash_token
from torchfarm.local_farm import LocalFarm
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings

pytestmark = pytest.mark.integration


def _request(width: int) -> pb.CompileRequest:
    return direct_request(
        torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Softplus()), torch.randn(2, 3)
    )


def test_a_tenant_over_its_compile_limit_is_refused_and_others_are_not():
    tenants = ",".join(f"{name}:{hash_token(tok)}" for name, tok in TOKENS.items())
    with LocalFarm(tenants=tenants, extra_env={"TORCHFARM_TENANT_MAX_COMPILES": "1"}) as farm:
        alice = ClientSettings(addr=farm.addr, token=TOKENS["alice"])
        bob = dataclasses.replace(alice, token=TOKENS["bob"])
        first, second, bobs = _request(13), _request(14), _request(15)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            waiting = pool.submit(remote.fetch, first, alice)  # a compile of ~20 s
            _wait_for_a_claim(farm)
            with pytest.raises(remote.FarmError, match="RESOURCE_EXHAUSTED.*limit 1"):
                remote.fetch(second, alice)
            bob_header, _ = pool.submit(remote.fetch, bobs, bob).result(timeout=600)
            header, _ = waiting.result(timeout=600)
        assert header.source == "miss" and bob_header.source == "miss"
        assert remote.fetch(first, alice)[0].source == "hit"  # hits need no slot
        assert remote.fetch(second, alice)[0].source == "miss"  # a slot is free again


def _wait_for_a_claim(farm, timeout_s: float = 60) -> None:
    """Until some compile is claimed: alice's first request is then waiting on it."""
    store = farm.store()
    deadline = time.monotonic() + timeout_s
    while not any(store.jobs.redis.scan_iter(match=keys.claim("*"))):
        assert time.monotonic() < deadline, "the first compile was never claimed"
        time.sleep(0.05)
