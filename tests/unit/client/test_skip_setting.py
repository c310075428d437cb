"""The skip is on by default (issue 26); one setting turns it off."""

from torchfarm.settings import ClientSettings


def test_the_skip_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("TORCHFARM_SKIP_TRACING", raising=False)
    assert ClientSettings.from_env().skip_tracing
    monkeypatch.setenv("TORCHFARM_SKIP_TRACING", "0")
    assert not ClientSettings.from_env().skip_tracing
