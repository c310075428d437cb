"""Precompiled C++ headers on a kernel-heavy CPU model: time to the first training step's
result, each in a fresh process with an empty Inductor cache, for local Inductor with the
headers off, on (built in that run, as on a first compile) and on (already built, as on every
later one), and for a farm miss once the worker has built its headers; plus one compile
child alone, with and without the worker's headers. Prints a table; `--json PATH` too.

    .venv/bin/python bench/precompiled_headers.py [--repeats 1] [--json PATH]
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from tests.integration.helpers import wait_for_precompiled_headers  # noqa: E402
from torchfarm.torch_adapter.worker import precompiled_headers  # noqa: E402

# Caches and headers of every measurement (~150 MB a header), removed at the end (main).
SCRATCH = ""


def block(cin: int, cout: int, stride: int) -> nn.Module:
    """A MobileNetV3-style inverted residual: expand, depthwise, squeeze-excite, project."""
    mid = cin * 4
    return nn.Sequential(
        nn.Conv2d(cin, mid, 1, bias=False),
        nn.BatchNorm2d(mid),
        nn.Hardswish(),
        nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False),
        nn.BatchNorm2d(mid),
        nn.Hardswish(),
        nn.Conv2d(mid, cout, 1, bias=False),
        nn.BatchNorm2d(cout),
    )


def model() -> nn.Module:
    layers = [nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.Hardswish()]
    for cin, cout, stride in ((16, 24, 2), (24, 24, 1), (24, 40, 2), (40, 40, 1), (40, 80, 2)):
        layers.append(block(cin, cout, stride))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(80, 10)]
    return nn.Sequential(*layers)


def step(backend: str) -> None:
    """In a fresh process: compile and run one training step; print seconds and source."""
    torch.manual_seed(0)
    net, x = model(), torch.randn(8, 3, 64, 64)
    started = time.perf_counter()
    loss = torch.compile(net, backend=backend)(x).square().mean()
    loss.backward()
    seconds = time.perf_counter() - started
    source = backend
    if backend == "torchfarm":
        from torchfarm.client.backend import history

        source = ",".join(sorted({r.source for r in history}))
    print(json.dumps({"seconds": seconds, "source": source}))


def measure(backend: str, headers: str = "1", tmp: str = "", addr: str = "") -> dict:
    cache = tempfile.mkdtemp(prefix="pch-bench-", dir=SCRATCH)
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=cache,
        TMPDIR=tmp
        or tempfile.mkdtemp(prefix="pch-bench-tmp-", dir=SCRATCH),  # where the header lives
        TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=headers,
        TORCHFARM_ADDR=addr,
        TORCHFARM_PROGRESS="0",
    )
    out = subprocess.run(
        [sys.executable, __file__, "--step", backend],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def child_alone(with_headers: bool) -> float:
    """One compile child (sandboxed, as on a miss) compiling the model's forward graph."""
    from tests.integration.helpers import direct_request
    from torchfarm.settings import WorkerSettings
    from torchfarm.workers import sandbox, toolchain

    settings = WorkerSettings.from_env()
    saved = dict(os.environ)
    try:
        if with_headers:
            directory = tempfile.mkdtemp(prefix="pch-bench-store-", dir=SCRATCH)
            precompiled_headers.set_store(directory)
            toolchain.build_headers(settings, directory)
        request = direct_request(model().eval(), torch.randn(8, 3, 64, 64))
        started = time.perf_counter()
        spec = sandbox.ChildSpec(request.graph, request.target, request.options)
        sandbox.run_compile(spec, settings)
        return time.perf_counter() - started
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if with_headers:
            shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", default="")
    parser.add_argument("--step", default="")
    args = parser.parse_args()
    if args.step:
        step(args.step)
        return
    global SCRATCH
    SCRATCH = tempfile.mkdtemp(prefix="pch-bench-")
    try:
        measure_all(args)
    finally:
        shutil.rmtree(SCRATCH, ignore_errors=True)


def measure_all(args: argparse.Namespace) -> None:
    from torchfarm.local_farm import LocalFarm

    runs: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        runs.setdefault(name, []).append(seconds)
        print(f"  {name}: {seconds:.1f} s", flush=True)

    for _ in range(args.repeats):
        add("local_headers_off", measure("inductor", headers="0")["seconds"])
        tmp = tempfile.mkdtemp(prefix="pch-bench-tmp-", dir=SCRATCH)
        add("local_headers_on_first", measure("inductor", tmp=tmp)["seconds"])
        add("local_headers_on_built", measure("inductor", tmp=tmp)["seconds"])
        add("child_headers_off", child_alone(False))
        add("child_headers_prebuilt", child_alone(True))
    with LocalFarm() as farm:
        wait_for_precompiled_headers(farm)
        for _ in range(args.repeats):
            farm.store().artifacts.redis.flushdb()
            farm.wait_ready(60)
            miss = measure("torchfarm", addr=farm.addr)
            assert miss["source"] == "miss", miss
            add("farm_miss", miss["seconds"])
    medians = {k: statistics.median(v) for k, v in runs.items()}
    print(f"\n{platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print("| case | seconds |\n|---|---|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(medians, f, indent=1)


if __name__ == "__main__":
    main()
