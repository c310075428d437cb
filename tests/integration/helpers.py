"""What integration tests share: tenant tokens, fresh client processes, direct requests."""

import json
import os
import subprocess
import sys
import tempfile

import torch

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-9876543210"}
ADMIN_TOKEN = "ops-admin-token-5555"  # in TORCHFARM_ADMINS, not a tenant
OP_LIBRARIES = "transformers.integrations.moe"  # custom operators of the coverage suite's MoE
HERE = os.path.dirname(os.path.abspath(__file__))


def run_client(
    farm,
    script: str,
    *args: str,
    tenant: str = "alice",
    path_prefix: str = "",
    env: dict | None = None,
) -> dict:
    """Run tests/integration/clients/SCRIPT in a fresh process with empty local Inductor and
    Triton caches."""
    full_env = dict(
        os.environ,
        TORCHFARM_ADDR=farm.addr,
        TORCHFARM_TOKEN=TOKENS[tenant],
        TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(),
        TRITON_CACHE_DIR=tempfile.mkdtemp(),
        **(env or {}),
    )
    if path_prefix:
        full_env["PATH"] = f"{path_prefix}:{full_env['PATH']}"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "clients", script), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
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
    return pb.CompileRequest(
        graph=captured["graph"], target=local_target(), options=pb.Options(mode=mode)
    )


def wait_for_precompiled_headers(farm, timeout_s: float = 900) -> None:
    """Until a worker of `farm` logs that its children have Inductor's precompiled headers."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name in os.listdir(farm.log_dir):
            if name.endswith(".log"):
                with open(os.path.join(farm.log_dir, name), errors="replace") as f:
                    if "precompiled headers ready" in f.read():
                        return
        time.sleep(2)
    raise TimeoutError(f"no worker built precompiled headers in {timeout_s:.0f} s: {farm.log_dir}")
