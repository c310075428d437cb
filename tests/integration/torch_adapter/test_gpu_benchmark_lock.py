"""A GPU's autotuning measurements one at a time across real processes (workers/gpu_lock.py,
torch_adapter/worker/gpu_benchmark_lock.py): two processes never measure at once, and
Inductor's GPU benchmark path holds the lock once installed (torch's hook from 2.13, its
benchmarker classes before, here on any release by taking the hook away). The lock's own
logic: tests/unit/workers/test_gpu_lock.py."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from torchfarm.workers import gpu_lock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


_MEASURE = """
import json, sys, time
from torchfarm.workers import gpu_lock
lock = gpu_lock._Lock(sys.argv[1])
spans = []
for _ in range(3):
    with lock.held():
        start = time.monotonic()
        time.sleep(0.15)
        spans.append((start, time.monotonic()))
print(json.dumps(spans))
"""


def test_two_processes_never_measure_at_once(tmp_path):
    path = gpu_lock.lock_file("0", str(tmp_path))
    runs = [
        subprocess.Popen([sys.executable, "-c", _MEASURE, path], stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    spans = sorted(s for run in runs for s in json.loads(run.communicate(timeout=60)[0]))
    assert len(spans) == 6
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end, spans


_INSTALLED = """
import json, sys
from torch._inductor.runtime import benchmarking
from torchfarm.workers import gpu_lock
from tests.unit.workers.test_gpu_lock import _taken_elsewhere as taken

path, way = sys.argv[1:]
seen = []
if way == "classes":  # as torch before 2.13 has them: without the hook
    vars(benchmarking).pop("set_gpu_benchmark_lock_context", None)
if way == "hook":  # torch 2.13 on
    gpu_lock.install(path)
    # what Inductor's benchmark_gpu (and its CUDA-graph and profiling variants) enter
    with benchmarking.maybe_gpu_benchmark_lock():
        seen.append(taken(path))
else:  # the classes' own benchmark_gpu, which measures only on a GPU: a probe stands in
    def probe(self, fn, **kwargs):
        seen.append(taken(path))
        return 1.0
    classes = [c for c in vars(benchmarking).values() if isinstance(c, type)
               and issubclass(c, benchmarking.Benchmarker) and "benchmark_gpu" in vars(c)]
    assert len(classes) >= 2, classes
    for cls in classes:
        cls.benchmark_gpu = probe
    gpu_lock.install(path)
    for cls in classes:
        cls.benchmark_gpu(benchmarking.benchmarker, lambda: None)
    benchmarking.benchmarker.benchmark_gpu(lambda: None)
seen.append(not taken(path))  # and released after
print(json.dumps(seen))
"""


@pytest.mark.parametrize("way", ["hook", "classes"])
def test_once_installed_inductors_gpu_benchmarks_hold_the_lock(tmp_path, way):
    from torch._inductor.runtime import benchmarking

    if way == "hook" and not hasattr(benchmarking, "set_gpu_benchmark_lock_context"):
        pytest.skip("torch before 2.13 has no lock hook: its classes are wrapped instead")
    path = gpu_lock.lock_file("0", str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_INSTALLED), path, way],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,  # where `tests` imports from
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(seen) >= 2 and all(seen), seen
