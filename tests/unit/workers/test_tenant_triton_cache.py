"""A tenant's Triton entries and tuning results (GPU pools, private compiles): the names a
kernel cache takes, keeping and pruning an entry as one, what a child reports as built or
reused (the child's lookups: tests/unit/torch_adapter/test_triton_cache.py)."""

import json
import os

import pytest

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.workers import kernel_cache

KEY = "A" * 26 + "B2" * 13  # Triton's base32 key: 52 characters of A-Z2-7
OTHER_KEY = "C" * 52
RESULT = "tuning/ab/" + "e" * 64 + ".best_config"
TIMINGS = "tuning/cache/" + "f" * 64


@pytest.mark.parametrize(
    "name",
    [
        f"triton/{KEY}/triton_poi_fused_add_0.json",
        f"triton/{KEY}/triton_poi_fused_add_0.cubin",
        f"triton/{KEY}/triton_.cubin",
        f"triton/{KEY}/triton_per_fused_1.hsaco",
        RESULT,
        "tuning/text/" + "0" * 64 + ".best_config",
        TIMINGS,
    ],
)
def test_triton_entries_and_tuning_results_are_kept(name):
    assert kernel_cache.is_kernel_name(name)


@pytest.mark.parametrize(
    "name",
    [
        f"triton/{KEY}/__grp__triton_poi_fused_add_0.json",  # a group file holds paths
        f"triton/{KEY}/cuda_utils.so",  # a launcher library
        f"triton/{KEY}/cuda_utils.c",
        f"triton/{KEY}/triton_.ptx",  # an IR: Triton serves an entry from its binary
        f"triton/{KEY}/triton_.llir",
        f"triton/{KEY[:-1]}/k.json",  # not a key
        f"triton/{KEY.lower()}/k.json",
        f"triton/{KEY}/../{OTHER_KEY}/k.json",
        f"triton/{KEY}/sub/k.json",
        "tuning/ab/" + "e" * 63 + ".best_config",
        "tuning/../ab/" + "e" * 64 + ".best_config",
        "tuning/cache/" + "f" * 64 + ".tmp",
        "tuning/fxgraph/" + "f" * 64,
    ],
)
def test_other_names_under_them_are_not(name):
    assert not kernel_cache.is_kernel_name(name)


def _entry(key: str, kernel: str = "k", size: int = 10) -> dict[str, bytes]:
    return {
        f"triton/{key}/{kernel}.json": b"{}",
        f"triton/{key}/{kernel}.cubin": b"c" * size,
    }


def test_a_triton_entry_is_kept_used_and_pruned_as_one(tmp_path):
    cache = kernel_cache.KernelCache(str(tmp_path / "root"), "toolchain", 100)
    d = cache.tenant_dir("cuda", "alice")
    assert cache.keep(d, pb.KernelFiles(built=_entry(KEY, size=40))) == (2, 0)
    assert cache.keep(d, pb.KernelFiles(built=_entry(OTHER_KEY, size=40))) == (2, 0)
    old = os.path.getmtime(os.path.join(d, f"triton/{KEY}/k.cubin")) - 100
    for name in _entry(OTHER_KEY):
        os.utime(os.path.join(d, name), (old, old))
    cache.touch(d, [f"triton/{KEY}"])  # KEY used now; OTHER_KEY was used long ago
    # Over the budget: the least recently used entry goes, metadata and binary together.
    cache.keep(d, pb.KernelFiles(built=_entry("D" * 52, size=40)))
    assert not os.path.exists(os.path.join(d, "triton", OTHER_KEY, "k.json"))
    assert not os.path.exists(os.path.join(d, "triton", OTHER_KEY, "k.cubin"))
    assert os.path.exists(os.path.join(d, "triton", KEY, "k.cubin"))
    assert os.path.exists(os.path.join(d, "triton", "D" * 52, "k.json"))


def test_a_triton_entry_is_never_replaced_but_tuning_results_are(tmp_path):
    cache = kernel_cache.KernelCache(str(tmp_path / "root"), "toolchain", 10_000)
    d = cache.tenant_dir("cuda", "alice")
    cache.keep(d, pb.KernelFiles(built={**_entry(KEY), RESULT: b"1", TIMINGS: b"a"}))
    cache.keep(d, pb.KernelFiles(built={f"triton/{KEY}/k.cubin": b"PLANTED", TIMINGS: b"ab"}))
    with open(os.path.join(d, f"triton/{KEY}/k.cubin"), "rb") as f:
        assert f.read() == b"c" * 10
    with open(os.path.join(d, TIMINGS), "rb") as f:
        assert f.read() == b"ab"  # a later compile's timings include the earlier ones


def test_staging_takes_the_tenants_entries_and_results(tmp_path):
    cache = kernel_cache.KernelCache(str(tmp_path / "root"), "toolchain", 10_000)
    d = cache.tenant_dir("cuda", "alice")
    cache.keep(d, pb.KernelFiles(built={**_entry(KEY), RESULT: b"1", TIMINGS: b"a"}))
    staging = tmp_path / "staging"
    staging.mkdir()
    assert kernel_cache.stage(d, str(staging)) == 4
    assert sorted(kernel_cache._names(str(staging))) == sorted([*_entry(KEY), RESULT, TIMINGS])


def _result(ms: int) -> bytes:
    return json.dumps({"XBLOCK": 64, "num_warps": 4, "time_taken_ms": ms}).encode()


def test_the_report_tells_built_from_reused(tmp_path):
    staged, cache_dir, triton_dir = tmp_path / "staged", tmp_path / "inductor", tmp_path / "triton"
    text, other_text = (
        "tuning/text/" + "1" * 64 + ".best_config",
        "tuning/text/" + "2" * 64 + ".best_config",
    )
    retuned, new = "cd/" + "9" * 64 + ".best_config", "ef/" + "8" * 64 + ".best_config"
    for directory, files in (
        (staged, {**_entry(KEY), RESULT: _result(1500), text: _result(5), TIMINGS: b"t"}),
        # The child: KEY served from the staged entry (its copy and a group file), OTHER_KEY
        # compiled here; a staged result used as it was, one found by its text and tuned
        # again, a new one, the timings grown.
        (triton_dir, {f"{KEY}/k.json": b"{}", f"{KEY}/__grp__k.json": b"{}"}),
        (triton_dir, {f"{OTHER_KEY}/k.json": b"{}", f"{OTHER_KEY}/k.cubin": b"new"}),
        (cache_dir, {RESULT[7:]: _result(1500), TIMINGS[7:]: b"tt"}),
        (cache_dir, {retuned: _result(6), new: _result(7)}),
    ):
        for name, data in files.items():
            os.makedirs(os.path.dirname(directory / name), exist_ok=True)
            (directory / name).write_bytes(data)
    path = lambda name: str(cache_dir / name)  # noqa: E731
    lookups = kernel_cache.TuningLookups(
        names={path(RESULT[7:]): text, path(retuned): text, path(new): other_text},
        found={path(RESULT[7:]): RESULT, path(retuned): text},
    )
    files = kernel_cache.report(str(cache_dir), str(staged), True, str(triton_dir), lookups)
    assert sorted(files.built) == sorted(
        [f"triton/{OTHER_KEY}/k.cubin", f"triton/{OTHER_KEY}/k.json", TIMINGS, text, other_text]
    )
    assert files.built[text] == _result(6) and files.built[other_text] == _result(7)
    assert list(files.reused) == [f"triton/{KEY}"]
    assert (files.tuning_reused, files.tuning_seconds_saved) == (1, 1.5)
    # A shared job's child reports only the pool's entries it took (for the counters and the
    # pool's least-recently-used order), nothing it made.
    shared = kernel_cache.report(str(cache_dir), str(staged), False, str(triton_dir))
    assert not shared.built and not shared.tuning_reused
    assert list(shared.reused) == [f"triton/{KEY}"]


def test_a_childs_triton_report_stops_at_its_cap_whole_entries_only(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_cache, "MAX_TRITON_REPORT_BYTES", 25)
    triton_dir = tmp_path / "triton"
    for key in (KEY, OTHER_KEY, "D" * 52):  # each entry 12 bytes: two fit, the third does not
        (triton_dir / key).mkdir(parents=True)
        (triton_dir / key / "k.json").write_bytes(b"{}")
        (triton_dir / key / "k.cubin").write_bytes(b"c" * 10)
        (triton_dir / key / "k.ptx").write_bytes(b"not kept")
    files = kernel_cache.report(
        str(tmp_path / "inductor"), str(tmp_path / "staged"), True, str(triton_dir)
    )
    assert sorted(files.built) == sorted([*_entry(KEY), *_entry(OTHER_KEY)])
