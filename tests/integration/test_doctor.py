"""`torchfarm doctor` against the real session farm: all clear, a wrong token, no gateway."""

import os
import socket
import subprocess
import sys
import tempfile

import pytest

from tests.integration.helpers import TOKENS

pytestmark = pytest.mark.integration


def _doctor(addr: str, token: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        TORCHFARM_ADDR=addr,
        TORCHFARM_TOKEN=token,
        TORCHFARM_CONNECT_TIMEOUT="1",
        TORCHFARM_PROGRESS="0",
        TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(),
    )
    return subprocess.run(
        [sys.executable, "-m", "torchfarm", "doctor"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_doctor_passes_every_check_against_a_healthy_farm(farm):
    proc = _doctor(farm.addr, TOKENS["alice"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("gateway", "token", "target", "pool", "round trip"):
        assert name in proc.stdout
    assert "passed their canary compile" in " ".join(proc.stdout.split())
    assert "output equals eager" in proc.stdout
    assert "FAIL" not in proc.stdout


def test_doctor_names_a_rejected_token_and_what_to_do(farm):
    proc = _doctor(farm.addr, "not-a-token")
    assert proc.returncode == 1
    assert "UNAUTHENTICATED" in proc.stdout and "TORCHFARM_TOKEN" in proc.stdout
    assert "round trip" not in proc.stdout  # skipped: it depends on the token


def test_doctor_reports_an_unreachable_gateway():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _doctor(f"127.0.0.1:{port}", "")
    assert proc.returncode == 1
    assert "unreachable" in proc.stdout and "gateway running" in proc.stdout
