"""Stream slots (issue 27, finding 1; issue 50, item 2): a tenant's share and the gateway's
cap, slots kept for a tenant's first stream, and the caps' defaults as shares of the
gateway's threads (the rest always serve short calls)."""

import pytest

from torchfarm.contract import busy
from torchfarm.gateway.admission import StreamSlots
from torchfarm.settings import GatewaySettings


def test_a_tenant_is_refused_past_its_share_and_the_last_slots_are_kept_for_newcomers():
    slots = StreamSlots(total=5, per_tenant=2)  # one slot kept for tenants holding none
    assert slots.reserve == 1
    assert slots.take("alice") is slots.take("alice") is None
    assert slots.take("alice") == (
        busy.TENANT,
        "this tenant has 2 streams open, the most it may have",
    )
    assert slots.take("bob") is slots.take("bob") is None
    assert slots.take("carol") is None  # her first stream: the kept slot
    scope, why = slots.take("dave")
    assert scope == busy.GATEWAY and "no stream free" in why
    slots.give("alice")
    assert slots.take("carol")[0] == busy.GATEWAY  # she holds one: the kept slot is not hers
    assert slots.take("dave") is None
    for owner in ("alice", "bob", "bob", "carol", "dave"):
        slots.give(owner)
    assert slots._open == {}


def test_the_caps_default_to_shares_of_the_threads_and_leave_some():
    settings = GatewaySettings(threads=128)
    assert (settings.max_streams, settings.tenant_max_streams) == (96, 32)
    assert GatewaySettings(threads=2).max_streams == 1
    assert GatewaySettings(threads=128).unauthenticated_streams == 8  # apart from tenants'
    with pytest.raises(ValueError, match="MAX_STREAMS"):
        GatewaySettings(threads=8, max_streams=8)
    with pytest.raises(ValueError, match="TENANT_MAX_STREAMS"):
        GatewaySettings(threads=8, max_streams=4, tenant_max_streams=5)
    with pytest.raises(ValueError, match="MESSAGE_TIMEOUT"):
        GatewaySettings(message_timeout_s=0)
