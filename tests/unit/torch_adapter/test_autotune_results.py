"""The worker's autotune result is filed so that torch's own recheck finds it on load.

CPU builds have no triton, so the configs here are stand-ins with the fields the autotune
cache reads; torch's own AutotuneCache writes the worker's file and torch's own
check_autotune_cache judges it.
"""

import types

import pytest
from torch._inductor.runtime import triton_heuristics as heuristics
from torch._inductor.runtime.autotune_cache import AutotuneCache

from torchfarm.torch_adapter import gate
from torchfarm.torch_adapter.load import autotune_results


class _Config:
    def __init__(self, xblock: int) -> None:
        self.kwargs = {"XBLOCK": xblock}
        self.num_warps, self.num_stages = 4, 1


META = {"coordinate_descent_tuning": True}


def _kernel(tmp_path, configs):
    """A bundled kernel as the artifact brings it: its source's path and its configs."""
    (tmp_path / "ab").mkdir(exist_ok=True)
    return types.SimpleNamespace(
        filename=str(tmp_path / "ab" / "kernel.py"),
        inductor_meta=META,
        compile_results=[types.SimpleNamespace(config=c) for c in configs],
    )


def _state(kernel) -> str:
    configs = [r.config for r in kernel.compile_results]
    _, _, info = heuristics.check_autotune_cache(configs, kernel.filename, META)
    return info["autotune_cache_state"]


@pytest.mark.skipif(gate.release_tuple() < (2, 13), reason="2.11 replaces the recheck")
def test_the_worker_result_is_filed_under_the_bundled_kernels_configs(tmp_path):
    started_from = [_Config(32), _Config(64), _Config(128)]
    kernel = _kernel(tmp_path, [started_from[1]])  # tuned at compile time: the winner only
    worker = AutotuneCache.create(META, kernel.filename, heuristics.hash_configs(started_from))
    worker.save(started_from[1], time_taken_ns=10**6)
    assert _state(kernel) == "miss"  # filed under the configs the worker started from
    autotune_results._file_under_these_configs(kernel)
    assert _state(kernel) == "hit"


def test_a_kernel_without_a_result_gets_none(tmp_path):
    kernel = _kernel(tmp_path, [_Config(64)])
    autotune_results._file_under_these_configs(kernel)
    assert sorted(p.name for p in (tmp_path / "ab").iterdir()) == []


def test_torch_recheck_is_wrapped_only_while_loading(tmp_path):
    original = heuristics.CachingAutotuner.recheck_autotune_cache
    with autotune_results.worker_results_win(str(tmp_path), {"ab/k.best_config"}):
        assert heuristics.CachingAutotuner.recheck_autotune_cache is not original
    assert heuristics.CachingAutotuner.recheck_autotune_cache is original


def test_a_coordinate_descent_result_keeps_its_mark_through_a_pickle():
    import pickle

    triton = pytest.importorskip("triton")
    config = triton.Config({"XBLOCK": 64}, num_warps=4, num_stages=1)
    config.found_by_coordesc = True  # as Inductor marks a stored coordinate-descent result
    data = pickle.dumps(config)
    assert not hasattr(pickle.loads(data), "found_by_coordesc")  # Triton drops it
    with autotune_results.coordesc_results_kept():
        kept = pickle.loads(data)
        plain = pickle.loads(pickle.dumps(triton.Config({"XBLOCK": 64})))
    assert kept.found_by_coordesc and kept.kwargs == {"XBLOCK": 64} and kept.num_stages == 1
    assert not hasattr(plain, "found_by_coordesc")
    assert not hasattr(pickle.loads(data), "found_by_coordesc")  # restored on exit
