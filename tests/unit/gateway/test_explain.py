"""A miss explained against the nearest entry of the same program, one case per key part,
against a bare redis-server; entries another tenant made are never compared, and its private
entries never looked at."""

import pytest
import redis

from torchfarm.cache.store import Store
from torchfarm.contract.cache_key import (
    STRUCTURE,
    key_parts,
    key_values,
    private_key,
    public_key,
)
from torchfarm.gateway.explain import explain
from torchfarm.proto import torchfarm_pb2 as pb

STRUCT = "5" * 64
TARGET = pb.Target(device="cpu", torch_version="2.13.0", python_version="3.11")
OPTIONS = pb.Options(mode="default", state=pb.TraceState(grad_enabled=True))
T0_LE_64 = pb.ShapeGuards(
    all=[
        pb.GuardExpr(
            apply=pb.GuardApply(
                op=pb.GuardApply.LE, args=[pb.GuardExpr(input=0), pb.GuardExpr(constant=64)]
            )
        )
    ]
)


def _copy(message):
    copied = type(message)()
    copied.CopyFrom(message)
    return copied


@pytest.fixture
def store(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield Store.from_clients(client)
    client.flushdb()


def _store_entry(
    store: Store,
    payload=b"graph",
    target=TARGET,
    options=OPTIONS,
    tenant="alice",
    private=False,
    guards=None,
    data=b"artifact",
) -> str:
    """What a worker stores: the entry with its key parts, and the structure index."""
    key = public_key(payload, target, options)
    stored_key = private_key(key, tenant) if private else key
    meta = pb.EntryMeta(
        tenant=tenant,
        private=private,
        guards=guards,
        key_parts=key_parts(payload, target, options, STRUCT),
        key_values=key_values(target, options),
    )
    store.artifacts.put(stored_key, data, meta)
    store.structures.add(tenant, STRUCT, stored_key)
    return key


def _ask(payload=b"graph", target=TARGET, options=OPTIONS, private=False, sizes=()) -> pb.Ask:
    return pb.Ask(
        key=public_key(payload, target, options),
        private=private,
        sizes=list(sizes),
        key_parts=key_parts(payload, target, options, STRUCT),
    )


def _differs(explanation: pb.MissExplanation) -> dict[str, str]:
    return {d.part: d.entry_value for d in explanation.differs}


def test_graph_differs(store):
    _store_entry(store, payload=b"graph at batch 8")
    explanation = explain(store, _ask(payload=b"graph at batch 16"), "alice")
    assert explanation.nearest_found
    assert _differs(explanation) == {"graph": ""}  # not readable: named only


def test_mode_differs_with_the_entry_value(store):
    _store_entry(store, options=pb.Options(mode="max-autotune", state=OPTIONS.state))
    explanation = explain(store, _ask(), "alice")
    assert _differs(explanation) == {"options.mode": "max-autotune"}


def test_config_patches_differ_by_name_only(store):
    patched = _copy(OPTIONS)
    patched.config_patches_json = '{"max_fusion_size": 8}'
    _store_entry(store, options=patched)
    assert _differs(explain(store, _ask(), "alice")) == {"options.config_patches": ""}


def test_trace_state_differs(store):
    no_grad = _copy(OPTIONS)
    no_grad.state.grad_enabled = False
    _store_entry(store, options=no_grad)
    assert _differs(explain(store, _ask(), "alice")) == {"trace_state.grad_enabled": "false"}


def test_torch_build_differs_and_the_nearest_wins(store):
    old_torch = _copy(TARGET)
    old_torch.torch_version = "2.11.0"
    _store_entry(store, payload=b"older graph", target=old_torch)  # two parts differ
    _store_entry(store, target=old_torch, data=b"other artifact")  # one part differs
    explanation = explain(store, _ask(), "alice")
    assert explanation.same_program == 2
    assert _differs(explanation) == {"target.torch_version": "2.11.0"}


def test_guards_that_failed_on_the_asked_sizes(store):
    _store_entry(store, guards=T0_LE_64)
    explanation = explain(store, _ask(sizes=[100]), "alice")
    assert list(explanation.failed_guards) == ["t0 <= 64"]
    assert explanation.nearest_found and not explanation.differs  # the key itself
    assert not explain(store, _ask(sizes=[10]), "alice").failed_guards


def test_no_entry_of_the_program(store):
    explanation = explain(store, _ask(), "alice")
    assert not explanation.nearest_found and explanation.same_program == 0


def test_another_tenants_private_entries_are_never_named(store):
    # bob's private entry equals alice's ask in every part but the key's privacy; alice's
    # own public entry differs in mode: she hears of hers only.
    _store_entry(store, tenant="bob", private=True)
    _store_entry(store, tenant="bob", private=True, guards=T0_LE_64, data=b"bob guarded")
    explanation = explain(store, _ask(sizes=[100]), "alice")
    assert not explanation.nearest_found
    assert explanation.same_program == 0
    assert not explanation.failed_guards
    alone = explain(store, _ask(private=True, sizes=[100]), "alice")  # her private key
    assert not alone.nearest_found and not alone.failed_guards
    _store_entry(store, options=pb.Options(mode="max-autotune", state=OPTIONS.state))
    explanation = explain(store, _ask(), "alice")
    assert explanation.same_program == 1
    assert _differs(explanation) == {"options.mode": "max-autotune"}
    # bob sees his own, nearest
    assert not explain(store, _ask(private=True), "bob").differs


def test_entries_without_a_structure_part_are_not_compared(store):
    ask = _ask()
    del ask.key_parts[STRUCTURE]
    _store_entry(store)
    assert not explain(store, ask, "alice").nearest_found


def test_entries_another_tenant_made_are_never_compared(store):
    """Finding 5 of issue 27: bob's shared entries of the same program were alice's nearest,
    telling her what bob compiled (architecture, mode, torch build)."""
    _store_entry(store, tenant="bob", options=pb.Options(mode="max-autotune", state=OPTIONS.state))
    explanation = explain(store, _ask(), "alice")
    assert not explanation.nearest_found and explanation.same_program == 0
    assert explain(store, _ask(), "bob").same_program == 1  # bob's own


def test_a_hostile_child_joins_only_its_own_tenants_structure_group(store):
    """Finding 5 of issue 27: the structure is what the compile child reports, so mallory's
    child can claim alice's program; its entry then joins mallory's group, never alice's, and
    alice hears only of her own entries."""
    _store_entry(store, tenant="alice", payload=b"alice's graph at batch 8")
    mallory = _store_entry(store, tenant="mallory", payload=b"anything")  # claims STRUCT
    assert mallory not in store.structures.keys("alice", STRUCT)
    assert store.structures.keys("mallory", STRUCT) == [mallory]
    explanation = explain(store, _ask(payload=b"alice's graph at batch 16"), "alice")
    assert explanation.same_program == 1 and _differs(explanation) == {"graph": ""}
    # a Redis writer that adds mallory's key to alice's group still names no entry of his
    store.structures.add("alice", STRUCT, mallory)
    assert explain(store, _ask(payload=b"alice's graph at batch 16"), "alice").same_program == 1
