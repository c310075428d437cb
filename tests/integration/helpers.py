"""What integration tests share: tenant tokens, fresh client processes, direct requests,
slowed compiles and what a farm's logs and counters say."""

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from tests.integration import warm_clients
from torchfarm.cache import keys
from torchfarm.gateway.auth import hash_token
from torchfarm.local_farm import LocalFarm

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-9876543210"}
ADMIN_TOKEN = "ops-admin-token-5555"  # in TORCHFARM_ADMINS, not a tenant
# The test farms' gateways compare a kept blob with the store again after this long (the
# default is 10 s); a test that changes the store under a gateway waits past it.
RECHECK_S = 1.0
RECHECK_ENV = {"TORCHFARM_GATEWAY_RECHECK_S": str(RECHECK_S)}


def past_gateway_memory() -> None:
    """Wait until a gateway reads again what it keeps of the store: a key's index entries
    (gateway/recent_index.py, TTL_S = 1 s) and the blobs it verified (RECHECK_S)."""
    time.sleep(RECHECK_S + 0.2)


OP_LIBRARIES = "transformers.integrations.moe"  # custom operators of the coverage suite's MoE
# What conftest sets in the tier's environment, for every farm a test starts (see there),
# and the pool kernel cache at its default size, for the farm that tests it.
TEST_FARM_DEFAULTS = {
    "TORCHFARM_KERNEL_CACHE_MB": "0",
    "TORCHFARM_WARM_CHILDREN": "1",
    "TORCHFARM_KERNEL_BUILD_PRIORITY": "normal",
}
KERNEL_CACHE_ON = {"TORCHFARM_KERNEL_CACHE_MB": "2048"}
HERE = os.path.dirname(os.path.abspath(__file__))


def session_farm(**env: str) -> LocalFarm:
    """The session farm's kind: every tenant of helpers.TOKENS, the admin, JSON logs. No
    TORCHFARM_OP_LIBRARIES: each compile child would import transformers (0.6 CPU-s) for the
    one model that calls its operator (test_coverage.py's farm imports it)."""
    tenants = ",".join(f"{name}:{hash_token(tok)}" for name, tok in TOKENS.items())
    # JSON log lines: test_operations checks that a request id follows a compile in them.
    return LocalFarm(
        tenants=tenants,
        admins=f"ops:{hash_token(ADMIN_TOKEN)}",
        extra_env={
            "TORCHFARM_LOG_FORMAT": "json",
            **RECHECK_ENV,
            **env,
        },
    )


def run_client(
    farm,
    script: str,
    *args: str,
    tenant: str = "alice",
    path_prefix: str = "",
    env: dict | None = None,
) -> dict:
    """Run tests/integration/clients/SCRIPT in a fresh process with empty local Inductor and
    Triton caches (removed afterwards: the tier runs hundreds of clients): a fork of a parent
    that has imported torch (warm_clients.py), or a new interpreter where that can't be."""
    with tempfile.TemporaryDirectory(prefix="torchfarm-client-") as caches:
        full_env = dict(
            os.environ,
            TORCHFARM_ADDR=farm.addr,
            TORCHFARM_TOKEN=TOKENS[tenant],
            TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
            TRITON_CACHE_DIR=os.path.join(caches, "triton"),
            **(env or {}),
        )
        if path_prefix:
            full_env["PATH"] = f"{path_prefix}:{full_env['PATH']}"
        argv = [os.path.join(HERE, "clients", script), *args]
        returncode, stdout, stderr = run_python(argv, full_env, 600)
    assert returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def run_python(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str, str]:
    """`python ARGV` as a fork of a parent that has imported torch (warm_clients.py), or a new
    interpreter where the environment is one torch reads when it loads: (exit status, stdout,
    stderr)."""
    with tempfile.TemporaryDirectory(prefix="torchfarm-output-") as outputs:
        out, err = os.path.join(outputs, "stdout"), os.path.join(outputs, "stderr")
        returncode = warm_clients.run(argv, env, out, err, timeout=timeout_s)
        if returncode is None:
            proc = subprocess.run(
                [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout_s
            )
            return proc.returncode, proc.stdout, proc.stderr
        with open(out) as f_out, open(err) as f_err:
            return returncode, f_out.read(), f_err.read()


def direct_request(model, *inputs, mode: str = "default", described: bool = False):
    """A CompileRequest for `model`'s Dynamo graph, for calls to the gateway without the
    backend (it compiles nothing locally); `described`: with its descriptor, as the
    backend sends a static graph's."""
    from torchfarm.compiler import descriptor, serialize
    from torchfarm.compiler.target import local_target
    from torchfarm.proto import torchfarm_pb2 as pb

    captured = {}

    def capture(gm, example_inputs):
        captured["graph"] = serialize.dumps(gm)
        captured["descriptor"] = descriptor.describe(gm) if described else b""
        return gm.forward

    torch.compile(model, backend=capture)(*inputs)
    return pb.CompileRequest(
        graph=captured["graph"],
        descriptor=captured["descriptor"],
        target=local_target(),
        options=pb.Options(mode=mode),
    )


def wait_for_precompiled_headers(farm, timeout_s: float = 900) -> None:
    """Until a worker of `farm` logs that its children have Inductor's precompiled headers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name in os.listdir(farm.log_dir):
            if name.endswith(".log"):
                with open(os.path.join(farm.log_dir, name), errors="replace") as f:
                    if "precompiled headers ready" in f.read():
                        return
        time.sleep(2)
    raise TimeoutError(f"no worker built precompiled headers in {timeout_s:.0f} s: {farm.log_dir}")


def start_slow_client(addr: str, seconds: float, model: str = "mlp") -> subprocess.Popen:
    """clients/slow_client.py against `addr`, its compile slowed by `seconds`."""
    env = dict(
        os.environ,
        TORCHFARM_ADDR=addr,
        TORCHFARM_TOKEN=TOKENS["alice"],
        TORCHFARM_PROGRESS="0",
        TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(),
        TRITON_CACHE_DIR=tempfile.mkdtemp(),
    )
    return subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "clients", "slow_client.py"),
            str(seconds),
            model,
            "infer",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result_of(client: subprocess.Popen) -> tuple[dict, str]:
    """The client's JSON line and its stderr, once it exits (successfully)."""
    out, err = client.communicate(timeout=600)
    assert client.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def log_of(farm, name: str) -> str:
    with open(os.path.join(farm.log_dir, f"{name}.log"), errors="replace") as f:
        return f.read()


def compiles(farm) -> int:
    return int(farm.store().counters.farm().get("compiles", 0))


def running_job(farm, timeout_s: float = 180) -> str:
    """The id of the job a worker runs now (holds its lease), once one does."""
    board = farm.store().jobs
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name in board.redis.scan_iter(match=keys.alive("*")):
            return name.decode().removeprefix(keys.alive(""))
        time.sleep(0.2)
    raise AssertionError(f"no compile started in {timeout_s:.0f} s")


def kernel_log(farm, kind: str = "objects reused") -> list[str]:
    """The messages of `farm`'s worker log lines about kernels that contain `kind` (default:
    `kernel cache: N objects reused, M kept`, one per compile), oldest first; JSON logs (the
    test farms') or text (`... INFO torchfarm.worker: message`)."""
    lines = []
    for name in sorted(os.listdir(farm.log_dir)):
        if name.endswith(".log"):
            with open(os.path.join(farm.log_dir, name), errors="replace") as f:
                for line in f:
                    if line.startswith("{") and "kernel" in line:
                        lines.append(json.loads(line)["message"])
                    elif "torchfarm.worker: " in line and "kernel" in line:
                        lines.append(line.split("torchfarm.worker: ", 1)[1].strip())
    return [line for line in lines if kind in line]


def wait_for_compile_builders(farm, timeout_s: float = 600) -> None:
    """Until every builder `farm`'s CPU worker keeps warm for the C++ builds its shared
    compiles hand it is ready (workers/kernel_builder.py, CompileBuilds)."""
    from torchfarm.settings import sizing

    deadline, builders = time.monotonic() + timeout_s, sizing.compile_kernel_builds()
    while len(kernel_log(farm, "kernel builder for compiles ready")) < builders:
        if time.monotonic() > deadline:
            raise TimeoutError(f"compile builders not ready in {timeout_s:.0f} s: {farm.log_dir}")
        time.sleep(1)


def pool_builds(farm) -> tuple[int, int, int]:
    """(kernel sources queued for the pool's builds, builds done, failed or skipped, jobs that
    offered sources: all those a compile did not have the pool build during it) so far."""
    offers = kernel_log(farm, "sources queued")
    queued = sum(int(line.split()[2]) for line in offers)
    return queued, len(kernel_log(farm, "pool kernel build")), len(offers)


def wait_for_pool_builds(farm, since: tuple[int, int, int], timeout_s: float = 900) -> None:
    """Until a job offered sources to the pool's builds after `since` (pool_builds), and every
    source queued so far has been built, failed or skipped."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        queued, done, offers = pool_builds(farm)
        if offers > since[2] and done >= queued:
            return
        time.sleep(2)
    raise TimeoutError(f"pool builds not done in {timeout_s:.0f} s: {pool_builds(farm)}")
