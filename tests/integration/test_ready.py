"""Ready means able to compile: a farm started from a checkout's parent directory (where the
repository root shadows the package) compiles; a worker whose canary compile fails ends
`torchfarm up` with its error, and the gateway, its health and `torchfarm doctor` say why."""

import os
import signal
import socket
import subprocess
import sys
import tempfile

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.helpers import direct_request
from torchfarm import local_farm
from torchfarm.compiler.target import local_target
from torchfarm.contract.pools import pool_name
from torchfarm.gateway.server import POOL_HEALTH_PREFIX
from torchfarm.local_farm import FarmNotReady, LocalFarm, free_port
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc
from torchfarm.settings.sizing import default_concurrency

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MISSING_OPS = "torchfarm_no_such_ops"  # an operator's TORCHFARM_OP_LIBRARIES typo
MISSING = f"No module named '{MISSING_OPS}'"


def _doctor(addr: str, cwd: str | None = None) -> tuple[int, str]:
    """Its exit status and its report, the table's wrapped lines joined back."""
    env = dict(
        os.environ,
        TORCHFARM_ADDR=addr,
        TORCHFARM_TOKEN="",
        TORCHFARM_PROGRESS="0",
        TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "torchfarm", "doctor"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc.returncode, " ".join((proc.stdout + proc.stderr).split())


def _up(
    cwd: str, how: str, env: dict | None = None, unset: tuple[str, ...] = ()
) -> subprocess.Popen:
    command = (
        [sys.executable, "-m", "torchfarm"]
        if how == "python -m torchfarm"
        else [os.path.join(os.path.dirname(sys.executable), "torchfarm")]
    )
    return subprocess.Popen(
        [*command, "up"],
        cwd=cwd,
        env={
            **{k: v for k, v in os.environ.items() if k not in unset},
            "TORCHFARM_TENANTS": "",
            **(env or {}),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("how", ["python -m torchfarm", "the console script"])
def test_a_farm_started_from_the_checkouts_parent_directory_compiles(tmp_path, how):
    os.symlink(ROOT, tmp_path / "torchfarm")  # <parent>/torchfarm: the repository root
    shadowed = subprocess.run(
        [sys.executable, "-c", "import torchfarm; print(torchfarm.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert shadowed.stdout.strip() == "None"  # the trap is set: a namespace package there
    # the worker's own default of warm children, not the one conftest sets for test farms
    proc = _up(str(tmp_path), how, unset=("TORCHFARM_WARM_CHILDREN",))
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("TORCHFARM_ADDR="), proc.stderr.read() if not line else line
        returncode, report = _doctor(line.split("=", 1)[1], cwd=str(tmp_path))
        assert returncode == 0, report
        slots = default_concurrency("cpu")  # the worker's default: its pool's size shows
        assert (
            f"ready: 1 of 1 workers passed their canary compile; {slots} compiles at once, "
            f"{slots} compile children kept warm" in report
        )
        assert "miss in" in report  # compiled by the farm's worker, not a hit
        assert "output equals eager" in report and "FAIL" not in report
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_up_exits_non_zero_with_the_workers_error_when_its_canary_fails(tmp_path):
    proc = _up(str(tmp_path), "python -m torchfarm", {"TORCHFARM_OP_LIBRARIES": MISSING_OPS})
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "TORCHFARM_ADDR" not in out  # never announced as ready
    assert "cannot compile" in err and MISSING in err, err[-3000:]


def test_gateway_health_and_doctor_report_a_pool_that_cannot_compile():
    pool = pool_name(local_target("cpu"))
    with LocalFarm(workers=0, tenants="") as farm:
        farm.start_worker("worker0", env={"TORCHFARM_OP_LIBRARIES": MISSING_OPS})
        with pytest.raises(FarmNotReady) as e:
            farm.wait_ready(600)
        assert f"pool {pool} cannot compile" in str(e.value) and MISSING in str(e.value)
        with grpc.insecure_channel(farm.addr) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(
                health_pb2.HealthCheckRequest(service=POOL_HEALTH_PREFIX + pool), timeout=10
            ).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            request = direct_request(lambda x: x.sin() + 1, torch.randn(4))
            with pytest.raises(grpc.RpcError) as refused:
                list(pb_grpc.FarmStub(channel).Compile(request, timeout=60))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"pool {pool} cannot compile" in refused.value.details()
            assert MISSING in refused.value.details()
        returncode, report = _doctor(farm.addr)
        assert returncode == 1
        assert f"{pool} cannot compile" in report and MISSING in report, report
        assert "round trip" not in report  # skipped: it depends on the pool


def test_a_gateway_whose_metrics_port_is_taken_before_it_binds_starts_again_on_another(
    monkeypatch,
):
    """A port picked free can be taken by any process of the host before the gateway binds
    it (the fresh-clone CI lost test_faults.py's farm to that): the farm starts it again."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken])  # the first metrics port picked: one already bound
        start_gateway = LocalFarm.start_gateway

        def first_on_a_taken_port(self, name="gateway"):
            with monkeypatch.context() as m:
                m.setattr(local_farm, "free_port", lambda: next(picks, None) or free_port())
                start_gateway(self, name)

        monkeypatch.setattr(LocalFarm, "start_gateway", first_on_a_taken_port)
        with LocalFarm(grpc_port=free_port(), workers=0, tenants="") as farm:
            farm.wait_ready(120)
            assert farm.metrics_port not in (0, taken)
            assert "Errno 98" in open(os.path.join(farm.log_dir, "gateway.log")).read()
