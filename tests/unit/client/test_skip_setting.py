"""The skip is off by default until a release's third-party zoo passes with it (issue 49);
TORCHFARM_SKIP_TRACING=1 turns it on, 0 off; `torch.compile(m, backend="torchfarm")` gets it
as `torchfarm.compile(m)` does (issue 49 item 4)."""

import pytest
import torch

import torchfarm
from torchfarm.client import decorator
from torchfarm.settings import ClientSettings
from torchfarm.torch_adapter.trace import dynamo_package

FARM = dict(addr="127.0.0.1:1", token="t")
FARM_ENV = {"TORCHFARM_ADDR": FARM["addr"], "TORCHFARM_TOKEN": FARM["token"]}


def test_unset_leaves_the_choice_to_the_release(monkeypatch):
    monkeypatch.delenv("TORCHFARM_SKIP_TRACING", raising=False)
    settings = ClientSettings.from_env(**FARM)
    assert settings.skip_tracing is None
    monkeypatch.setattr(dynamo_package, "DEFAULT_ON", ())
    assert not decorator.skips_tracing(settings)
    monkeypatch.setattr(dynamo_package, "DEFAULT_ON", dynamo_package.VERIFIED)
    assert decorator.skips_tracing(settings) == dynamo_package.supported()


def test_the_variable_turns_it_on_or_off(monkeypatch):
    monkeypatch.setattr(dynamo_package, "DEFAULT_ON", ())
    monkeypatch.setenv("TORCHFARM_SKIP_TRACING", "1")
    assert decorator.skips_tracing(ClientSettings.from_env(**FARM)) == dynamo_package.supported()
    monkeypatch.setenv("TORCHFARM_SKIP_TRACING", "0")
    monkeypatch.setattr(dynamo_package, "DEFAULT_ON", dynamo_package.VERIFIED)
    assert ClientSettings.from_env().skip_tracing is False
    assert not decorator.skips_tracing(ClientSettings.from_env(**FARM))


def test_the_named_backend_gets_the_skip_only_when_it_is_on(monkeypatch):
    """The entry point's lookup has torch.compile offer its compiles to take_over only with the
    skip on; take_over itself declines when the skip is off by the time of the compile."""
    from torchfarm.client import backend, entry
    from torchfarm.torch_adapter.trace import named_backend

    monkeypatch.setattr(backend, "start", lambda settings: None)
    monkeypatch.setattr(named_backend, "_take_overs", {})
    for name, value in FARM_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHFARM_SKIP_TRACING", "0")
    assert entry.torchfarm_backend is backend.torchfarm_backend
    assert named_backend._take_overs == {}
    assert (
        decorator.take_over(torch.nn.Linear(2, 2), named_backend.Compile(None, None, None, False))
        is None
    )
    monkeypatch.setenv("TORCHFARM_SKIP_TRACING", "1")
    assert entry.torchfarm_backend is backend.torchfarm_backend
    assert named_backend._take_overs == (
        {backend.torchfarm_backend: decorator.take_over} if dynamo_package.supported() else {}
    )


@pytest.mark.skipif(not dynamo_package.supported(), reason="the skip is off on this torch release")
def test_torch_compile_gets_the_decorators_package(monkeypatch):
    """`torch.compile(m, backend="torchfarm", ...)` builds what `torchfarm.compile(m, ...)`
    builds with the same arguments, its package key naming the entry point. A module class
    traces as always, and so does `module.compile()` (torch's own `_call_impl`)."""
    from torchfarm.client import backend
    from torchfarm.torch_adapter.trace import named_backend

    built = []
    monkeypatch.setattr(decorator, "_with_package", lambda *args, **kw: built.append((args, kw)))
    monkeypatch.setattr(backend, "start", lambda settings: None)
    monkeypatch.setitem(named_backend._take_overs, backend.torchfarm_backend, decorator.take_over)
    for name, value in {**FARM_ENV, "TORCHFARM_SKIP_TRACING": "1"}.items():
        monkeypatch.setenv(name, value)
    model = torch.nn.Linear(2, 2)
    torch.compile(model, backend=backend.torchfarm_backend, mode="max-autotune", dynamic=True)
    torchfarm.compile(model, mode="max-autotune", dynamic=True)
    (named, named_kw), (decorated, decorated_kw) = built
    assert named[0] is decorated[0] is model
    chosen = dict(mode="max-autotune", dynamic=True, fullgraph=False, options=None)
    assert named[3] == decorated[3] == chosen
    assert (named_kw, decorated_kw) == ({"entry": "torch.compile"}, {})
    assert named[1].keywords == dict(mode="max-autotune", options=None)
    assert named[1].func is decorated[1].func is backend.torchfarm_backend
    Model = type("Model", (torch.nn.Linear,), {})
    assert decorator.take_over(Model, named_backend.Compile(None, None, None, False)) is None
    model.compile(backend=backend.torchfarm_backend)
    assert len(built) == 2
