"""The timings a pool's GEMM measurement (torch_adapter/worker/gemm_problems.py) files are the
ones a later compile of another graph with that GEMM finds: it benchmarks no candidate and
computes what eager does (the parsing and range checks: tests/unit/torch_adapter/)."""

import json
import os

import torch

from tests.unit.torch_adapter.test_gemm_problems import _bmm
from torchfarm.torch_adapter.compile import gemm_benchmarks
from torchfarm.torch_adapter.worker import gemm_problems


class _Bmm(torch.nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b).tanh()  # not the graph the measurement compiles


def _inductor_cache_at(monkeypatch, directory) -> None:
    """Inductor's cache dir for this process from now on: the timings file's path is cached
    at first use (CacheBase.get_local_cache_path), as a fresh process would find it."""
    from torch._inductor.codecache import CacheBase

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(directory))
    CacheBase.get_local_cache_path.cache_clear()


def test_the_timings_a_measurement_files_are_found_by_a_later_compile(tmp_path, monkeypatch):
    """On the CPU, max-autotune benchmarks a bmm's C++ template and ATen's kernel."""
    measured, later = tmp_path / "measured", tmp_path / "later"
    _inductor_cache_at(monkeypatch, measured)
    with gemm_benchmarks.counted() as count:
        gemm_problems.measure(_bmm((4, 32, 48), (4, 48, 32)), "cpu")
    assert count.candidates > 0
    ((op, key, precision),) = {*count.problems}  # the same GEMM twice: found the second time
    assert gemm_problems.problem(op, key, precision, "cpu") == _bmm((4, 32, 48), (4, 48, 32))
    (timings,) = os.listdir(measured / "cache")
    with open(measured / "cache" / timings) as f:
        assert key in json.load(f)["cache"]["bmm"]

    (later / "cache").mkdir(parents=True)
    os.link(measured / "cache" / timings, later / "cache" / timings)
    _inductor_cache_at(monkeypatch, later)
    torch._dynamo.reset()
    a, b = torch.randn(4, 32, 48), torch.randn(4, 48, 32)
    model = torch.compile(_Bmm(), mode="max-autotune-no-cudagraphs")
    with gemm_benchmarks.counted() as count:
        assert torch.allclose(model(a, b), _Bmm()(a, b), atol=1e-5)
    assert count.candidates == 0 and not count.problems
    torch._inductor.codecache.CacheBase.get_local_cache_path.cache_clear()  # for what follows
