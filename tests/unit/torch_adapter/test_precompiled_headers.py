"""Children see the worker's precompiled headers, and have them on, only once all are built,
at the very path where Inductor looks for them (that path, asked of this torch:
tests/integration/torch_adapter/test_precompiled_headers.py)."""

import json

import pytest

from torchfarm.torch_adapter.worker import precompiled_headers

KEY = "cgrt36rh5wdrff5r2qmf4bofnv2ifsjexxmaf4xem6f4iddeco77"


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHFARM_PRECOMPILED_HEADERS_DIR", str(tmp_path))
    for name in (f"{KEY}.h", f"{KEY}.h.gch"):
        (tmp_path / name).write_text(name)
    return tmp_path


def test_children_get_nothing_and_headers_off_until_the_build_is_recorded(store):
    assert precompiled_headers.child_binds("/tmp", "nobody") == []
    assert precompiled_headers.child_environment() == {
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"
    }
    precompiled_headers.record(str(store), [f"{KEY}.h", f"{KEY}.h.gch"])
    where = "/tmp/torchinductor_nobody/precompiled_headers"
    assert precompiled_headers.child_binds("/tmp", "nobody") == [
        (str(store / f"{KEY}.h"), f"{where}/{KEY}.h"),
        (str(store / f"{KEY}.h.gch"), f"{where}/{KEY}.h.gch"),
    ]
    assert precompiled_headers.child_environment() == {
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "1"
    }


def test_a_build_without_a_compiled_header_is_never_recorded(store):
    with pytest.raises(RuntimeError, match="no precompiled header"):
        precompiled_headers.record(str(store), [f"{KEY}.h", "missing.h.gch"])
    assert not (store / precompiled_headers.MANIFEST).exists()
    assert precompiled_headers.child_environment()[precompiled_headers.FLAG_ENV] == "0"


def test_outside_a_worker_children_get_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHFARM_PRECOMPILED_HEADERS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / precompiled_headers.MANIFEST).write_text(json.dumps([f"{KEY}.h.gch"]))
    assert precompiled_headers.child_binds("/tmp", "nobody") == []
    assert precompiled_headers.child_environment()[precompiled_headers.FLAG_ENV] == "0"
