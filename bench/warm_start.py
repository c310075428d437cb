"""Warm-start benchmark: time to first result of a compiled training step, each in a fresh
process, for (a) local cold compile, (b) PyTorch's local warm disk cache, (c) farm miss,
(d) farm hit on an empty local cache. Runs on an embedded farm; prints each and the ratios.

    .venv/bin/python bench/warm_start.py [--repeats 3]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

import torch

from torchfarm.local_farm import LocalFarm

CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "first_result.py")


def measure(backend: str, cache_dir: str, addr: str = "") -> dict:
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=cache_dir,
        TRITON_CACHE_DIR=cache_dir + "-triton",
        TORCHFARM_ADDR=addr,
        TORCHFARM_PROGRESS="0",
    )
    out = subprocess.run(
        [sys.executable, CLIENT, backend], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {k: [] for k in "abcd"}
    with LocalFarm() as farm:
        store = farm.store()
        for _ in range(args.repeats):
            warm = tempfile.mkdtemp()
            runs["a"].append(measure("inductor", warm)["seconds"])
            runs["b"].append(measure("inductor", warm)["seconds"])
            # an empty farm cache (job state and pools live on the broker)
            store.artifacts.redis.flushdb()
            farm.wait_ready(60)
            miss = measure("torchfarm", tempfile.mkdtemp(), farm.addr)
            assert miss["source"] == "miss", miss
            runs["c"].append(miss["seconds"])
            hit = measure("torchfarm", tempfile.mkdtemp(), farm.addr)
            assert hit["source"] == "hit", hit
            runs["d"].append(hit["seconds"])
    med = {k: statistics.median(v) for k, v in runs.items()}
    names = {
        "a": "local cold compile",
        "b": "local warm cache (PyTorch)",
        "c": "farm miss",
        "d": "farm hit, empty local cache",
    }
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, {args.repeats} repeats (median; all runs in brackets)"
    )
    for k in "abcd":
        print(f"({k}) {names[k]:<30} {med[k]:7.2f} s  {[round(x, 2) for x in runs[k]]}")
    print(f"(d)/(b) = {med['d'] / med['b']:.2f}   (target <= 1.1)")
    print(f"(a)/(d) = {med['a'] / med['d']:.1f}x")


if __name__ == "__main__":
    main()
