"""`torchfarm up`'s block for the operator: shell-exportable lines and notes, the recovery
URL in a file only its user can read, and where to get an admin token when it made none."""

import os
import stat
import types

from torchfarm.cli import _operator_block


def _farm(tmp_path):
    return types.SimpleNamespace(
        workdir=str(tmp_path),
        addr="127.0.0.1:8470",
        redis_url="redis://:secret@127.0.0.1:6380/0",
        log_dir=str(tmp_path),
        blob_url=f"file://{tmp_path}/blobs",
    )


def test_the_block_gives_the_address_the_token_it_made_and_the_recovery_file(tmp_path):
    block = _operator_block(_farm(tmp_path), "tf_0123_token", tenants="")
    lines = block.split("\n")
    assert lines[:2] == ["TORCHFARM_ADDR=127.0.0.1:8470", "TORCHFARM_ADMIN_TOKEN=tf_0123_token"]
    assert lines[-1] == "" and all(line.startswith("# ") for line in lines[2:-1])
    assert "secret" not in block and "OPEN farm" in block
    url_file = tmp_path / "redis.url"
    assert url_file.read_text() == "redis://:secret@127.0.0.1:6380/0"
    assert stat.S_IMODE(os.stat(url_file).st_mode) == 0o600
    recovery = f'torchfarm cache stats --redis "$(cat {url_file})"'
    assert f"TORCHFARM_BLOB_URL=file://{tmp_path}/blobs {recovery}" in block


def test_with_admins_given_it_says_where_a_token_comes_from(tmp_path):
    block = _operator_block(_farm(tmp_path), "", tenants="alice:" + "0" * 64)
    assert "TORCHFARM_ADMIN_TOKEN=" not in block
    assert "TORCHFARM_ADMINS" in block and "torchfarm token NAME" in block
    assert "OPEN" not in block
