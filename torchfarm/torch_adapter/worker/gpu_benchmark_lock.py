"""Make every GPU benchmark of this process's Inductor hold a lock (workers/gpu_lock.py's:
one measurement at a time per GPU, across a worker's compile processes).

Uses `torch._inductor.runtime.benchmarking.set_gpu_benchmark_lock_context` where torch has it
(2.13 on: the hook PyTorch added for harnesses that benchmark from several processes,
pytorch#184905; it wraps benchmark_gpu, its CUDA-graph variant and do_bench_using_profiling);
before (2.11, 2.12), the `benchmark_gpu` of each Benchmarker class of that module, which
autotuning, coordinate descent and pad_mm call (there `do_bench_using_profiling`, used only
under Inductor's profiling options, is not covered). Not covered either: candidates
benchmarked in Inductor's subprocess pool (TORCHFARM_SPREAD_TUNING: its processes never
load this).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager


def install(held: Callable[[], AbstractContextManager[None]]) -> None:
    """From here on, every GPU benchmark of this process's Inductor runs inside `held()`."""
    from torch._inductor.runtime import benchmarking

    if hasattr(benchmarking, "set_gpu_benchmark_lock_context"):
        benchmarking.set_gpu_benchmark_lock_context(held)
        return
    for cls in vars(benchmarking).values():
        if (
            isinstance(cls, type)
            and issubclass(cls, benchmarking.Benchmarker)
            and "benchmark_gpu" in vars(cls)
        ):
            setattr(cls, "benchmark_gpu", _holding(held, vars(cls)["benchmark_gpu"]))  # noqa: B010


def _holding(held: Callable[[], AbstractContextManager[None]], method):
    @functools.wraps(method)
    def benchmark_gpu(*args, **kwargs):
        with held():
            return method(*args, **kwargs)

    return benchmark_gpu
