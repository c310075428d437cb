"""What a private GPU compile finds of its tenant's earlier work: Triton's entries through
Triton's own cache manager (StagedFirst), and autotune results under the names Inductor
looks them up by (result_path), placed before Inductor compiles the kernel."""

import json
import os

import pytest

from torchfarm.workers import kernel_cache

TIMINGS = "tuning/cache/" + "f" * 64
KEY = "A" * 52


def _result(ms: int) -> bytes:
    return json.dumps({"XBLOCK": 64, "num_warps": 4, "time_taken_ms": ms}).encode()


def test_result_path_is_where_inductors_autotune_cache_looks(tmp_path, monkeypatch):
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    from torchfarm.torch_adapter.load import autotune_results

    path = str(tmp_path / "ab" / ("c" + "ab" * 26 + ".py"))
    cache = AutotuneCache.create({}, path, "configs-hash")
    assert cache is not None and cache.local_cache is not None
    assert autotune_results.result_path(path) == cache.local_cache[1]
    assert autotune_results.result_path(path).endswith(".best_config")


def test_a_child_finds_the_staged_timings_at_once_and_a_kernels_result_by_its_text(
    tmp_path, monkeypatch
):
    from torch._inductor import async_compile, codecache

    from torchfarm.torch_adapter.load import autotune_results

    staged, cache_dir = tmp_path / "staged", tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    # One kernel at two positions of two graphs: its name, and so its module, differs.
    first = "@triton.jit\ndef triton_poi_fused_add_3(x):\n    pass  # triton_poi_fused_add_3\n"
    second = first.replace("_3", "_5")
    by_text = kernel_cache.text_name("triton_poi_fused_add_3", first)
    assert by_text == kernel_cache.text_name("triton_poi_fused_add_5", second)
    for staged_name, data in ((TIMINGS, b"t"), (by_text, _result(3))):
        os.makedirs(os.path.dirname(staged / staged_name), exist_ok=True)
        (staged / staged_name).write_bytes(data)
    result = autotune_results.result_path(codecache.PyCodeCache.write(second)[1])
    compiled = []
    monkeypatch.setattr(
        async_compile.AsyncCompile, "triton", lambda self, n, s, *a: compiled.append(n)
    )
    with kernel_cache.looking_up(str(staged), str(cache_dir)) as lookups:
        assert (cache_dir / TIMINGS[7:]).read_bytes() == b"t"
        assert not os.path.exists(result)
        async_compile.AsyncCompile().triton("triton_poi_fused_add_5", second)
        assert compiled == ["triton_poi_fused_add_5"]
        assert open(result, "rb").read() == _result(3)  # before Inductor compiled it
    assert async_compile.AsyncCompile.triton.__name__ == "<lambda>"  # restored
    assert lookups.names == {result: by_text} and lookups.found == {result: by_text}
    files = kernel_cache.report(str(cache_dir), str(staged), True, "", lookups)
    assert (files.tuning_reused, files.tuning_seconds_saved) == (1, 0.003)
    assert not files.built  # the timings as staged, the result as found


@pytest.fixture
def triton_dirs(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    own, staged = tmp_path / "own", tmp_path / "staged"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(own))
    from torchfarm.torch_adapter.worker import triton_cache

    for name, value in triton_cache.environment(str(staged)).items():
        monkeypatch.setenv(name, value)
    return own, staged


def test_triton_finds_a_staged_entry_by_its_key_and_serves_it_from_its_own_dir(triton_dirs):
    import base64

    from triton.runtime.cache import get_cache_manager

    own, staged = triton_dirs
    digest = "ab" * 32  # the sha256 of a compile's key, as triton.compile passes it
    key = base64.b32encode(bytes.fromhex(digest)).decode().rstrip("=")  # the entry's name
    (staged / key).mkdir(parents=True)
    (staged / key / "k.json").write_text("{}")
    (staged / key / "k.cubin").write_bytes(b"binary")
    manager = get_cache_manager(digest)  # Triton's own factory
    assert type(manager).__name__ == "StagedFirst" and manager.key == key
    group = manager.get_group("k.json")
    assert group == {"k.json": str(own / key / "k.json"), "k.cubin": str(own / key / "k.cubin")}
    assert (own / key / "k.cubin").read_bytes() == b"binary"
    assert get_cache_manager(digest).get_group("k.json") == group  # Triton's own lookup now


def test_no_staged_entry_or_one_without_metadata_is_a_miss(triton_dirs):
    from torchfarm.torch_adapter.worker.triton_cache import StagedFirst

    own, staged = triton_dirs
    (staged / KEY).mkdir(parents=True)
    (staged / KEY / "k.cubin").write_bytes(b"binary")
    assert StagedFirst(KEY).get_group("k.json") is None
    assert StagedFirst("B" * 52).get_group("k.json") is None
    assert not os.path.exists(own / KEY / "k.cubin")
