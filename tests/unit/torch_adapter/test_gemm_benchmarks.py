"""Algorithm selection's benchmarked candidates, counted through the installed torch's own
lookup (torch_adapter/compile/gemm_benchmarks.py): a miss counts every candidate handed to the
benchmark, timings found in the cache count none, each benchmarking's problem (op, inputs key,
matmul precision) is remembered unless a size hint was overridden (another key), and the lookup
is restored afterwards."""

from torch._inductor.select_algorithm import AlgorithmSelectorCache

from torchfarm.torch_adapter.compile import gemm_benchmarks


class _Choice:
    def __init__(self, name: str) -> None:
        self.name = name

    def hash_key(self) -> str:
        return self.name


def _benchmark(choices):
    return {c: 1.0 for c in choices}


def test_candidates_benchmarked_are_counted_and_timings_found_are_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    selector, choices = AlgorithmSelectorCache(), [_Choice("cpp"), _Choice("aten")]
    with gemm_benchmarks.counted() as count:
        assert selector.lookup(choices, "bmm", "8x64x96", _benchmark) == dict.fromkeys(choices, 1.0)
        assert count.candidates == 2
        selector.lookup(choices, "bmm", "8x64x96", _benchmark)  # the timings are cached now
        selector.lookup([_Choice("x")], "bmm", "8x64x96", benchmark=None)  # a check only
        assert count.candidates == 2
        selector.lookup(choices[:1], "mm", "64x96", _benchmark, hint_override=None)
        assert count.candidates == 3
        selector.lookup(choices[:1], "mm", "32x96", _benchmark, hint_override=32)
        assert count.candidates == 4
    assert count.problems == [("bmm", "8x64x96", "highest"), ("mm", "64x96", "highest")]
    assert "lookup" not in AlgorithmSelectorCache.__dict__  # inherited again, as it was
