"""The autotune results an artifact carries: collected on the worker, unpacked on the client.

GPU-only in effect (CPU kernels are not autotuned); these tests cover the file handling,
which runs on every load. bench/gpu/run.sh proves the effect on the GPU.
"""

import os

from torch._inductor.runtime.autotune_cache import AutotuneCacheArtifact
from torch._inductor.runtime.triton_heuristics import CachingAutotuner

from torchfarm.compiler import inductor


def test_the_worker_ships_the_result_files_of_its_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "k1.best_config").write_bytes(b'{"XBLOCK": 64}')
    (tmp_path / "ab" / "k1.py").write_bytes(b"source")
    assert inductor._tuned_configs() == {"ab/k1.best_config": b'{"XBLOCK": 64}'}


def test_the_client_writes_only_well_formed_names_inside_the_artifact_dir(tmp_path):
    directory = tmp_path / "artifact"
    directory.mkdir()
    tuned = {
        "ab/k1.best_config": b"{}",
        "../escape.best_config": b"{}",
        "ab/../../escape2.best_config": b"{}",
        "/tmp/abs.best_config": b"{}",
        "ab/k2.py": b"import os",
    }
    with inductor._autotune_results_here(str(directory), tuned):
        pass
    written = sorted(
        os.path.relpath(os.path.join(root, f), tmp_path)
        for root, _, names in os.walk(tmp_path)
        for f in names
    )
    assert written == ["artifact/ab/k1.best_config"]


def test_torch_is_patched_only_while_loading(tmp_path):
    populate, recheck = (
        AutotuneCacheArtifact.populate_cache,
        CachingAutotuner.recheck_autotune_cache,
    )
    with inductor._autotune_results_here(str(tmp_path), {"ab/k.best_config": b"{}"}):
        assert AutotuneCacheArtifact.populate_cache is not populate
        assert CachingAutotuner.recheck_autotune_cache is not recheck
    assert AutotuneCacheArtifact.populate_cache is populate
    assert CachingAutotuner.recheck_autotune_cache is recheck


def test_the_workers_final_result_wins_over_the_one_inductor_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    final = b'{"XBLOCK": 128, "found_by_coordesc": true}'
    with inductor._autotune_results_here(str(tmp_path), {"ab/k.best_config": final}):
        AutotuneCacheArtifact("ab/k.best_config", b'{"XBLOCK": 64}').populate_cache()
        AutotuneCacheArtifact("cd/other.best_config", b'{"XBLOCK": 32}').populate_cache()
    assert (tmp_path / "ab" / "k.best_config").read_bytes() == final
    assert (tmp_path / "cd" / "other.best_config").exists()  # not carried: Inductor's stays
