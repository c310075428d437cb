"""docker-compose.yml, checked without a Docker engine: the Compose specification's schema,
commands that exist, workers that scale, a GPU profile, and every variable documented."""

import os
import re

import jsonschema
import pytest
import typer.main
import yaml

from torchfarm.cli import app

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA = os.path.join(ROOT, ".cache", "compose-spec.json")  # made by `make test`
_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _raw() -> str:
    with open(os.path.join(ROOT, "docker-compose.yml")) as f:
        return f.read()


@pytest.fixture(scope="module")
def compose() -> dict:
    """The file as compose sees it with an empty environment: every ${VAR:-default} resolved."""
    return yaml.safe_load(_VARIABLE.sub(lambda m: m.group(2) or "", _raw()))


def test_compose_file_follows_the_compose_specification(compose):
    import json

    with open(SCHEMA) as f:
        schema = json.load(f)
    validator = jsonschema.Draft201909Validator(schema)
    validator.validate(compose)  # raises with the offending path
    broken = dict(compose, services={"gateway": {"image": "x", "ports": "8470"}})
    with pytest.raises(jsonschema.ValidationError):  # the check can fail
        validator.validate(broken)


def test_every_torchfarm_service_runs_a_command_the_package_has(compose):
    commands = set(typer.main.get_command(app).commands)
    for name, service in compose["services"].items():
        if "build" in service and "entrypoint" not in service:
            assert service["command"][0] in commands, f"{name}: {service['command']}"
    assert {"gateway", "worker"} <= commands


def test_workers_scale_and_the_gpu_worker_is_opt_in(compose):
    services = compose["services"]
    for name in ("worker-cpu", "worker-gpu"):
        assert "ports" not in services[name] and "container_name" not in services[name]
    assert services["worker-gpu"]["profiles"] == ["gpu"]
    assert "profiles" not in services["worker-cpu"]
    device = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert all("healthcheck" in services[s] for s in ("redis", "gateway"))
    assert "--appendonly" in services["redis"]["command"]


def test_every_variable_the_compose_file_reads_is_in_env_example():
    with open(os.path.join(ROOT, ".env.example")) as f:
        documented = {line.split("=", 1)[0] for line in f if re.match(r"^\w+=", line)}
    used = {m.group(1) for m in _VARIABLE.finditer(_raw())}
    assert used <= documented, used - documented
