"""The compatibility gate: verified releases pass, anything else is named in one line."""

import importlib.metadata
import warnings

import pytest
import torch

from torchfarm import torch_adapter
from torchfarm.torch_adapter import gate


def test_the_installed_torch_is_verified():
    assert gate.release(torch.__version__) in gate.VERIFIED
    assert torch_adapter.UNVERIFIED is None
    assert gate.installed_version() == torch.__version__


def test_the_local_tag_names_the_build_not_the_release():
    assert gate.unverified("2.13.0+cpu") is None
    assert gate.unverified("2.15.0+cu132") is None
    assert gate.release_tuple("2.11.0+cu130") == (2, 11, 0)
    assert gate.release_tuple("2.16.0a0+git1234") == (2, 16, 0)


@pytest.mark.parametrize("version", ["2.14.0", "2.12.0", "2.16.0", "2.13.1", "2.15.0a0+gitabc"])
def test_an_unverified_torch_is_named_with_the_verified_ones(version, monkeypatch):
    monkeypatch.delenv(gate.ALLOW_UNVERIFIED_ENV, raising=False)
    assert gate.unverified(version) == (
        f"torch {version} is not verified (verified: 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0)"
    )


def test_an_operator_may_accept_an_unverified_torch_with_a_loud_warning(monkeypatch):
    monkeypatch.setenv(gate.ALLOW_UNVERIFIED_ENV, "1")
    gate._warn_allowed.cache_clear()
    with pytest.warns(RuntimeWarning, match=r"torch 2\.14\.0 is not verified.*anyway"):
        assert gate.unverified("2.14.0") is None


def test_a_worker_on_an_unverified_torch_exits_with_one_line(monkeypatch):
    monkeypatch.delenv(gate.ALLOW_UNVERIFIED_ENV, raising=False)
    monkeypatch.setattr(gate, "installed_version", lambda: "2.14.0")
    with pytest.raises(SystemExit) as exit_:
        gate.require_verified_for_worker()
    message = str(exit_.value.code)
    assert "\n" not in message
    assert message.startswith("torchfarm: torch 2.14.0 is not verified (verified: 2.11.0")
    assert gate.ALLOW_UNVERIFIED_ENV in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setattr(gate, "installed_version", lambda: "2.13.0+cpu")
        gate.require_verified_for_worker()  # a verified torch: no exit, no warning


def test_the_worker_command_refuses_an_unverified_torch(monkeypatch):
    from typer.testing import CliRunner

    from torchfarm.cli import app

    monkeypatch.delenv(gate.ALLOW_UNVERIFIED_ENV, raising=False)
    monkeypatch.setattr(gate, "installed_version", lambda: "2.14.0")
    result = CliRunner().invoke(app, ["worker", "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "torchfarm: torch 2.14.0 is not verified (verified: 2.11.0, 2.12.1, 2.13.0, 2.14.1, "
        "2.15.0); this "
        f"worker does not start (set {gate.ALLOW_UNVERIFIED_ENV}=1 to run it anyway)"
    ]


def test_the_package_specifier_admits_exactly_the_verified_releases():
    from packaging.requirements import Requirement

    requirement = next(
        Requirement(r)
        for r in importlib.metadata.requires("torchfarm")
        if Requirement(r).name == "torch"
    )
    offered = [
        "2.10.0", "2.11.0", "2.12.0", "2.12.1", "2.13.0", "2.14.0", "2.14.1", "2.15.0",
        "2.15.1", "2.16.0",
    ]  # fmt: skip
    admitted = [v for v in offered if requirement.specifier.contains(v)]
    assert admitted == list(gate.VERIFIED)


def test_a_client_on_an_unverified_torch_compiles_locally_with_one_warning(monkeypatch):
    from torchfarm.client import backend, records

    reason = "torch 2.14.0 is not verified (verified: 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0)"
    monkeypatch.setattr(torch_adapter, "UNVERIFIED", reason)
    monkeypatch.setattr(records, "_warned", set())
    monkeypatch.setenv("TORCHFARM_ADDR", "127.0.0.1:1")  # never asked
    torch._dynamo.reset()
    model = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    before = len(backend.history)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="torchfarm")
        assert torch.allclose(compiled(x), model(x))
    lines = [str(w.message) for w in caught if str(w.message).startswith("torchfarm")]
    assert lines == [f"torchfarm: {reason}; compiling locally"]
    assert {r.source for r in backend.history[before:]} == {"local"}
