"""The skip is off by default until a release's third-party zoo passes with it (issue 49);
TORCHFARM_SKIP_TRACING=1 turns it on, 0 off."""

from torchfarm.client import decorator
from torchfarm.settings import ClientSettings
from torchfarm.torch_adapter.trace import dynamo_package

FARM = dict(addr="127.0.0.1:1", token="t")


def test_unset_leaves_the_choice_to_the_release(monkeypatch):
    monkeypatch.delenv("TORCHFARM_SKIP_TRACING", raising=False)
    settings = ClientSettings.from_env(**FARM)
    assert settings.skip_tracing is None
    monkeypatch.setattr(dynamo_package, "DEFAULT_ON", ())
    assert not decorator._skips_tracing(settings)
    monkeypatch.setattr(dynamo_package, "DEFAULT_ON", dynamo_package.VERIFIED)
    assert decorator._skips_tracing(settings) == dynamo_package.supported()


def test_the_variable_turns_it_on_or_off(monkeypatch):
    monkeypatch.setattr(dynamo_package, "DEFAULT_ON", ())
    monkeypatch.setenv("TORCHFARM_SKIP_TRACING", "1")
    assert decorator._skips_tracing(ClientSettings.from_env(**FARM)) == dynamo_package.supported()
    monkeypatch.setenv("TORCHFARM_SKIP_TRACING", "0")
    monkeypatch.setattr(dynamo_package, "DEFAULT_ON", dynamo_package.VERIFIED)
    assert ClientSettings.from_env().skip_tracing is False
    assert not decorator._skips_tracing(ClientSettings.from_env(**FARM))
