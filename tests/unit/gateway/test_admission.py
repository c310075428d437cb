"""Stream slots (issue 27, finding 1): a tenant's cap and the gateway's, and the caps'
defaults as shares of the gateway's threads (the rest always serve short calls)."""

import pytest

from torchfarm.gateway.admission import StreamSlots
from torchfarm.settings import GatewaySettings


def test_a_tenant_is_refused_past_its_cap_and_everyone_past_the_total():
    slots = StreamSlots(total=3, per_tenant=2)
    assert slots.take("alice") == slots.take("alice") == ""
    assert "this tenant" in slots.take("alice")
    assert slots.take("bob") == ""
    assert "the gateway" in slots.take("carol")
    slots.give("alice")
    assert slots.take("carol") == ""
    assert "the gateway" in slots.take("alice")
    for owner in ("alice", "bob", "carol"):
        slots.give(owner)
    assert slots._open == {}


def test_the_caps_default_to_shares_of_the_threads_and_leave_some():
    settings = GatewaySettings(threads=128)
    assert (settings.max_streams, settings.tenant_max_streams) == (96, 32)
    assert GatewaySettings(threads=2).max_streams == 1
    with pytest.raises(ValueError, match="MAX_STREAMS"):
        GatewaySettings(threads=8, max_streams=8)
    with pytest.raises(ValueError, match="TENANT_MAX_STREAMS"):
        GatewaySettings(threads=8, max_streams=4, tenant_max_streams=5)
    with pytest.raises(ValueError, match="MESSAGE_TIMEOUT"):
        GatewaySettings(message_timeout_s=0)
