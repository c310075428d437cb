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
# ${VAR}, ${VAR:-default} / ${VAR-default}, and ${VAR:?message} (compose refuses to start
# without VAR): group 2 is the operator, group 3 the default or the message.
_VARIABLE = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")
# closed by default: no open gateway, no Redis or object store without a secret
REQUIRED = {"TORCHFARM_TENANTS", "REDIS_PASSWORD", "S3_SECRET_KEY"}


def _raw() -> str:
    with open(os.path.join(ROOT, "docker-compose.yml")) as f:
        return f.read()


@pytest.fixture(scope="module")
def compose() -> dict:
    """The file as compose sees it with an environment holding only the required variables:
    every ${VAR:-default} resolved, every ${VAR:?message} set."""
    return yaml.safe_load(_VARIABLE.sub(_resolve, _raw()))


def _resolve(match: re.Match) -> str:
    name, operator, value = match.groups()
    if name in REQUIRED:
        return f"{name.lower()}-value"
    return value or "" if operator and operator.endswith("-") else ""


def test_authentication_and_a_redis_password_are_required():
    required = {m.group(1) for m in _VARIABLE.finditer(_raw()) if (m.group(2) or "").endswith("?")}
    assert required == REQUIRED


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


def test_redis_has_a_password_and_the_web_uis_are_published_on_loopback_only(compose):
    services = compose["services"]
    for name in ("redis", "broker"):
        assert services[name]["command"][-2:] == ["--requirepass", "redis_password-value"]
    urls = [
        value
        for service in services.values()
        for value in (service.get("environment") or {}).values()
        if str(value).startswith("redis://")
    ]
    assert urls and all(url.startswith("redis://:redis_password-value@") for url in urls)
    assert services["gateway"]["environment"]["TORCHFARM_TENANTS"] == "torchfarm_tenants-value"
    for name in ("flower", "prometheus"):
        assert all(port.startswith("127.0.0.1:") for port in services[name]["ports"])


def test_the_cache_cli_needs_the_gateway_and_an_admin_token_only(compose):
    """`torchfarm cache` reaches a compose farm through the published gateway port with a
    token of TORCHFARM_ADMINS (its imports trusting TORCHFARM_VERIFY_KEYS): both reach the
    gateway; no Redis port is published, so store credentials never leave the host."""
    gateway = compose["services"]["gateway"]
    assert {"TORCHFARM_ADMINS", "TORCHFARM_VERIFY_KEYS"} <= set(gateway["environment"])
    assert any(str(p).endswith(":8470") for p in gateway["ports"])
    for name in ("redis", "broker"):
        assert not compose["services"][name].get("ports"), name


def test_artifact_bytes_live_in_the_object_store_and_its_port_stays_inside(compose):
    services = compose["services"]
    assert "ports" not in services["seaweedfs"]
    secret = services["seaweedfs"]["environment"]["AWS_SECRET_ACCESS_KEY"]
    assert secret == "s3_secret_key-value"
    for name in ("gateway", "worker-cpu", "worker-gpu"):
        env = services[name]["environment"]
        assert env["TORCHFARM_BLOB_URL"].startswith("s3://torchfarm?endpoint=http://seaweedfs:")
        assert env["AWS_SECRET_ACCESS_KEY"] == secret
        assert "seaweedfs" in services[name]["depends_on"]
