"""The table of TORCHFARM_* variables (settings/env.py): the README's table is generated
from it, and a variable reads as the table says."""

import pathlib

import pytest

from torchfarm.compiler import compilers
from torchfarm.settings import ClientSettings, GatewaySettings, WorkerSettings, env
from torchfarm.settings.__main__ import with_table

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_the_readmes_table_is_the_generated_one():
    text = README.read_text()
    assert with_table(text) == text, "run: python -m torchfarm.settings --readme README.md"


def test_every_field_of_a_service_names_a_variable_with_its_default():
    for cls in (ClientSettings, GatewaySettings, WorkerSettings):
        for field in cls.__dataclass_fields__.values():
            assert field.default == env.default(field.metadata["env"]), field.name


def test_the_default_compilers_are_the_built_in_ones():
    assert compilers.DEFAULT.split(",") == list(compilers.BUILT_IN)


@pytest.mark.parametrize(
    ("short", "text", "value"),
    [
        ("PARALLEL_GRAPHS", "", 8),  # blank: the default
        ("PARALLEL_GRAPHS", " 3 ", 3),
        ("CONNECT_TIMEOUT", "0.5", 0.5),
        ("PROGRESS", "no", False),  # on unless said off
        ("PROGRESS", "anything", True),
        ("PRIVATE", "yes", True),  # off unless said on
        ("PRIVATE", "anything", False),
        ("SKIP_TRACING", "", None),  # unset: the release decides
        ("SKIP_TRACING", "0", False),
        ("SANDBOX_BINDS", "/opt/a, ,/opt/b", ("/opt/a", "/opt/b")),
        ("KERNEL_NAMES", " content ", "content"),
    ],
)
def test_a_variable_reads_as_its_type_says(monkeypatch, short, text, value):
    monkeypatch.setenv(env.name(short), text)
    assert env.get(short) == value


def test_a_bad_value_gets_its_settings_one_message(monkeypatch):
    monkeypatch.setenv("TORCHFARM_GATEWAY_THREADS", "many")
    with pytest.raises(ValueError, match="TORCHFARM_GATEWAY_THREADS must be a whole number"):
        GatewaySettings.from_env()
    monkeypatch.setenv("TORCHFARM_KERNEL_NAMES", "short")
    with pytest.raises(ValueError, match="must be unique or content, not 'short'"):
        WorkerSettings.from_env()
    with pytest.raises(ValueError, match="must be unique or content, not 'short'"):
        WorkerSettings(kernel_names="short")


def test_an_override_wins_in_this_process_only_and_ends_with_its_block(monkeypatch):
    monkeypatch.setenv("TORCHFARM_ADDR", "farm:1")
    with env.override(ADDR="other:2", TOKEN=None, WAIT=False):
        assert ClientSettings.from_env().addr == "other:2"
        assert ClientSettings.from_env().wait is False
        assert env.raw("TOKEN") == ""
    assert ClientSettings.from_env().addr == "farm:1"
    assert ClientSettings.from_env().wait is True


def test_a_childs_environment_is_written_as_the_table_reads_it():
    assert env.environ(GATEWAY_INSECURE=True, METRICS_PORT=0) == {
        "TORCHFARM_GATEWAY_INSECURE": "1",
        "TORCHFARM_METRICS_PORT": "0",
    }
    with pytest.raises(KeyError):
        env.environ(NO_SUCH_VARIABLE="1")
