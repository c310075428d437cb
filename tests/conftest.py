"""Fixtures: one real embedded farm (redis-server, gateway, Celery worker) per session."""

import json
import os
import subprocess
import sys
import tempfile

# The test process's own local Inductor cache starts empty and is private to the run.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchfarm-test-inductor-")

import pytest  # noqa: E402
import torch  # noqa: E402

from torchfarm.cache.store import Store  # noqa: E402
from torchfarm.client import backend  # noqa: E402
from torchfarm.gateway.auth import hash_token  # noqa: E402
from torchfarm.local_farm import LocalFarm  # noqa: E402

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-9876543210"}
ADMIN_TOKEN = "ops-admin-token-5555"  # in TORCHFARM_ADMINS, not a tenant
OP_LIBRARIES = "transformers.integrations.moe"  # custom operators of the coverage suite's MoE
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def farm():
    tenants = ",".join(f"{name}:{hash_token(tok)}" for name, tok in TOKENS.items())
    # JSON log lines: test_operations checks that a request id follows a compile in them.
    with LocalFarm(tenants=tenants, extra_env={
            "TORCHFARM_LOG_FORMAT": "json",
            # the coverage suite's MoE model calls transformers' custom grouped-mm operator
            "TORCHFARM_OP_LIBRARIES": OP_LIBRARIES,
            "TORCHFARM_ADMINS": f"ops:{hash_token(ADMIN_TOKEN)}"}) as f:
        yield f


@pytest.fixture
def store(farm) -> Store:
    return farm.store()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    backend.history.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def compiler_log(tmp_path):
    """A PATH whose g++/gcc/c++ log every call before running the real compiler."""
    bindir, log = tmp_path / "bin", tmp_path / "cc.log"
    bindir.mkdir()
    for name in ("g++", "gcc", "c++", "cc"):
        real = subprocess.run(["which", name], capture_output=True, text=True).stdout.strip()
        if real:
            script = bindir / name
            script.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {real} "$@"\n')
            script.chmod(0o755)
    return str(bindir), log


def run_client(farm, script: str, *args: str, tenant: str = "alice", path_prefix: str = "",
               env: dict | None = None) -> dict:
    """Run tests/clients/SCRIPT in a fresh process with empty local Inductor/Triton caches."""
    full_env = dict(os.environ, TORCHFARM_ADDR=farm.addr, TORCHFARM_TOKEN=TOKENS[tenant],
                    TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(), TRITON_CACHE_DIR=tempfile.mkdtemp(),
                    **(env or {}))
    if path_prefix:
        full_env["PATH"] = f"{path_prefix}:{full_env['PATH']}"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "clients", script), *args],
                          env=full_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def direct_request(model, *inputs, mode: str = "default"):
    """A CompileRequest for `model`'s Dynamo graph, for calls to the gateway without the
    backend (it compiles nothing locally)."""
    from torchfarm.compiler import serialize
    from torchfarm.compiler.target import local_target
    from torchfarm.proto import torchfarm_pb2 as pb

    captured = {}

    def capture(gm, example_inputs):
        captured["graph"] = serialize.dumps(gm)
        return gm.forward

    torch.compile(model, backend=capture)(*inputs)
    return pb.CompileRequest(graph=captured["graph"], target=local_target(),
                             options=pb.Options(mode=mode))
