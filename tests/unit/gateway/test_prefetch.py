"""Prefetch on the gateway, against a bare redis-server: what a tenant's program was served is
recorded per position, and a hit of its head lists the rest, per tenant, entries verified."""

import pytest
import redis

from torchfarm.cache.programs import MAX_POSITIONS
from torchfarm.cache.store import Store
from torchfarm.contract.cache_key import private_key
from torchfarm.gateway.coordinator import Coordinator
from torchfarm.proto import torchfarm_pb2 as pb

KEYS = [f"{i:x}" * 64 for i in range(1, 5)]  # 64 hex digits each


@pytest.fixture
def coordinator(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield Coordinator(
        Store.from_clients(client), enqueue=lambda job, pool: None, compile_timeout_s=5
    )
    client.flushdb()


def _serve(coordinator: Coordinator, tenant: str, private=False) -> list[str]:
    """A run of a 4-graph program: each graph stored (as a worker does) and recorded as served."""
    digests = []
    for position, key in enumerate(KEYS):
        stored_key = private_key(key, tenant) if private else key
        entry = coordinator.store.artifacts.put(
            stored_key,
            f"artifact {position}".encode(),
            pb.EntryMeta(tenant=tenant, private=private),
        )
        ask = pb.Ask(key=key, private=private, program=pb.Program(head=KEYS[0], position=position))
        coordinator.record_program(ask, tenant, entry.digest)
        digests.append(entry.digest)
    return digests


def _head(private=False) -> pb.Ask:
    return pb.Ask(key=KEYS[0], private=private, program=pb.Program(head=KEYS[0], position=0))


def test_a_hit_of_the_head_lists_the_rest_of_the_program(coordinator):
    digests = _serve(coordinator, "alice")
    manifest = coordinator.manifest(_head(), "alice")
    assert manifest is not None
    assert [(e.key, e.digest, e.position) for e in manifest.entries] == [
        (KEYS[i], digests[i], i) for i in (1, 2, 3)
    ]
    later = pb.Ask(key=KEYS[1], program=pb.Program(head=KEYS[0], position=1))
    assert coordinator.manifest(later, "alice") is None  # only the head's hit sends one


def test_another_tenant_gets_no_manifest_of_this_tenants_program(coordinator):
    _serve(coordinator, "alice", private=True)
    assert coordinator.manifest(_head(), "bob") is None
    assert coordinator.manifest(_head(private=True), "bob") is None
    assert coordinator.manifest(_head(private=True), "alice") is not None


def test_entries_gone_or_not_visible_are_left_out(coordinator):
    digests = _serve(coordinator, "alice")
    coordinator.store.artifacts.drop(KEYS[2])
    manifest = coordinator.manifest(_head(), "alice")
    assert manifest is not None
    assert [e.digest for e in manifest.entries] == [digests[1], digests[3]]
    # a public program's run as private asks: its private keys hold nothing
    assert coordinator.manifest(_head(private=True), "alice") is None


def test_positions_are_bounded(coordinator):
    programs = coordinator.store.programs
    programs.record("alice", KEYS[0], MAX_POSITIONS, KEYS[1], "d" * 64)
    programs.record("alice", KEYS[0], -1, KEYS[1], "d" * 64)
    assert programs.entries("alice", KEYS[0]) == []
