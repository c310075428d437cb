"""TLS between clients and the gateway, with certificates the test makes with openssl; a
gateway beyond loopback serves TLS unless the operator says --insecure (issue 50, item 5)."""

import os
import subprocess
import sys
import tempfile

import pytest
import torch
from typer.testing import CliRunner

import torchfarm
from torchfarm.cli import app
from torchfarm.client import backend, remote
from torchfarm.local_farm import FarmNotReady, LocalFarm
from torchfarm.settings import ClientSettings

pytestmark = pytest.mark.integration


def _self_signed(directory) -> tuple[str, str]:
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            key,
            "-out",
            cert,
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,IP:0.0.0.0,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture(scope="module")
def tls_farm(tmp_path_factory):
    cert, key = _self_signed(tmp_path_factory.mktemp("tls"))
    with LocalFarm(tls=(cert, key)) as farm:
        yield farm, cert


def test_a_client_trusting_the_gateways_ca_compiles_over_tls(tls_farm, monkeypatch):
    farm, cert = tls_farm
    monkeypatch.setenv("TORCHFARM_TLS_CA", cert)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(torchfarm.compile(model, addr=farm.addr)(x), model(x))
    assert [r.source for r in backend.history] == ["miss"]


@pytest.mark.parametrize("trust", ["nothing (plaintext)", "another CA"])
def test_a_client_that_does_not_trust_the_gateway_gets_nothing(tls_farm, tmp_path, trust):
    farm, _ = tls_farm
    tls_ca = "" if trust.startswith("nothing") else _self_signed(tmp_path)[0]
    settings = ClientSettings(addr=farm.addr, connect_timeout_s=1, tls_ca=tls_ca)
    with pytest.raises(remote.FarmError, match="unreachable"):
        remote.lookup("0" * 64, settings)


def test_doctor_reports_tls(tls_farm):
    farm, cert = tls_farm
    env = dict(
        os.environ,
        TORCHFARM_ADDR=farm.addr,
        TORCHFARM_TLS_CA=cert,
        TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(),
        TORCHFARM_PROGRESS="0",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "torchfarm", "doctor"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TLS, trusting" in proc.stdout and "output equals eager" in proc.stdout


PLAINTEXT_REFUSED = "refusing to listen on 0.0.0.0 in plaintext"


def test_a_gateway_beyond_loopback_serves_tls_or_plaintext_only_when_told(tmp_path):
    """Without a certificate a gateway on 0.0.0.0 does not start (nor does `up`, before it
    starts anything); --insecure starts it in plaintext; with a certificate it serves TLS,
    which a client trusting the CA reaches and one trusting nothing does not."""
    with pytest.raises(FarmNotReady, match="gateway exited"):
        with LocalFarm(workers=0, host="0.0.0.0", log_dir=str(tmp_path)):
            pass
    assert PLAINTEXT_REFUSED in (tmp_path / "gateway.log").read_text()
    refused = CliRunner().invoke(app, ["up", "--host", "0.0.0.0"])
    assert refused.exit_code == 2 and PLAINTEXT_REFUSED in refused.output
    with LocalFarm(workers=0, host="0.0.0.0", insecure=True) as farm:
        assert remote.lookup("0" * 64, ClientSettings(addr=farm.addr)) == []
    cert, key = _self_signed(tmp_path)
    with LocalFarm(workers=0, host="0.0.0.0", tls=(cert, key)) as farm:
        assert remote.lookup("0" * 64, ClientSettings(addr=farm.addr, tls_ca=cert)) == []
        plaintext = ClientSettings(addr=farm.addr, connect_timeout_s=1)
        with pytest.raises(remote.FarmError, match="unreachable"):
            remote.lookup("0" * 64, plaintext)
