"""Every `torchfarm cache` command against the session farm's real compiled entries, through
the gateway with an admin token alone; the recovery mode (direct store access) too."""

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from tests.integration.helpers import ADMIN_TOKEN, TOKENS, direct_request
from torchfarm.cli import app
from torchfarm.client import remote
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings

pytestmark = pytest.mark.integration


def _request(width: int, mode: str = "default") -> pb.CompileRequest:
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU())
    return direct_request(model, torch.randn(4, 16), mode=mode)


def _cli(*args: str) -> dict | list:
    result = CliRunner().invoke(app, ["cache", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_cache_cli_on_real_compiled_entries(farm, store, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHFARM_ADDR", farm.addr)
    monkeypatch.setenv("TORCHFARM_ADMIN_TOKEN", ADMIN_TOKEN)
    for name in ("TORCHFARM_REDIS_URL", "TORCHFARM_VERIFY_KEYS"):  # no store credentials
        monkeypatch.delenv(name, raising=False)
    settings = dataclasses.replace(ClientSettings(token=TOKENS["bob"]), addr=farm.addr)
    first, second = _request(24), _request(40, mode="max-autotune-no-cudagraphs")
    header, _ = remote.fetch(first, settings)
    remote.fetch(second, settings)
    again, _ = remote.fetch(first, settings)
    assert again.source == "hit" and again.digest == header.digest

    rows = {r["key"]: r for r in _cli("ls", "--tenant", "bob", "--limit", "0")}
    row = rows[header.key]
    assert row["hits"] >= 1 and row["last_hit"] >= row["created"] > 0
    assert row["mode"] == "default" and row["tenant"] == "bob"
    assert row["compile_seconds"] > 0 and row["size"] > 0 and row["torch_version"]
    assert row["target"].startswith("cpu") and row["pool"].startswith("cpu-")
    assert [
        r["mode"] for r in _cli("ls", "--tenant", "bob", "--mode", "max-autotune-no-cudagraphs")
    ] == ["max-autotune-no-cudagraphs"]

    shown = _cli("show", header.key[:20])
    entry = shown["entries"][0]
    assert "linear" in entry["graph_code"] and entry["op_counts"]
    assert any(k["name"].startswith("cpp_") and k["source_bytes"] > 0 for k in entry["kernels"])
    assert entry["objects"] and all(o["bytes"] > 0 for o in entry["objects"])
    for view in (["show", header.key], ["ls"], ["stats"]):  # the tables people read
        result = CliRunner().invoke(app, ["cache", *view])
        assert result.exit_code == 0, (view, result.output)
        assert (header.key[:16] if view != ["stats"] else "compile s") in result.output, view

    stats = _cli("stats")
    assert {"entries", "bytes", "hits", "misses"} <= set(stats)
    assert stats["entries"] >= 2 and stats["hits"] >= 1 and stats["misses"] >= 2
    assert stats["compile_seconds_saved"] > 0
    assert stats["pools"][row["pool"]]["entries"] >= 2

    bundle = tmp_path / "warm.tfbundle"
    assert _cli("export", str(bundle))["entries"] >= 2
    assert _cli("rm", header.key)["entries_removed"] == 1
    assert header.key not in {r["key"] for r in _cli("ls", "--limit", "0")}
    assert _cli("import", str(bundle))["entries"] >= 2
    restored, _ = remote.fetch(first, settings)
    assert restored.source == "hit" and restored.digest == header.digest

    pool = f"--target={row['pool']}"
    assert _cli("purge", pool)["keys_removed"] >= 2
    assert not _cli("ls", pool) and _cli("stats")["pools"][row["pool"]]["entries"] == 0

    damaged = tmp_path / "damaged.tfbundle"
    raw = bytearray(bundle.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    result = CliRunner().invoke(app, ["cache", "import", str(damaged)])
    assert result.exit_code != 0
    assert "nothing imported" in result.output or "not a torchfarm bundle" in result.output


def test_a_tenant_token_is_refused_and_the_recovery_mode_reads_the_store(farm, monkeypatch):
    monkeypatch.setenv("TORCHFARM_ADDR", farm.addr)
    refused = CliRunner().invoke(app, ["cache", "stats", "--token", TOKENS["alice"]])
    assert refused.exit_code == 1 and "PERMISSION_DENIED" in refused.output
    through_gateway = json.loads(
        CliRunner()
        .invoke(app, ["cache", "ls", "--limit", "0", "--json", "--token", ADMIN_TOKEN])
        .output
    )
    monkeypatch.delenv("TORCHFARM_ADDR")  # the gateway is not asked
    monkeypatch.setenv("TORCHFARM_BLOB_URL", farm.blob_url)  # direct access: where blobs live
    direct = _cli("ls", "--limit", "0", "--redis", farm.redis_url)
    assert {r["key"] for r in direct} == {r["key"] for r in through_gateway}
    assert _cli("stats", "--redis", farm.redis_url)["entries"] == len(direct)
