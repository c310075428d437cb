"""The pool's kernel builds (workers/kernel_builder.py): CPU and wall time to build the C++
sources of one real compile, side by side in one run:

- one builder per source: a sandboxed builder child started for each source (what every
  build cost before builders took bursts: imports and ISA checks each time);
- one builder for the burst: the same sources through one builder child, each built in a
  process forked from its untouched state.

The sources are those a training step's compile of a small transformer (bench/
sibling_kernels.py's model A) asks Inductor to build, recorded as a shared job's child
records them. CPU seconds are the whole machine's busy time during each row (/proc/stat):
run it on a quiet machine.
Prints a table and the ratio; `--json PATH` too.

    .venv/bin/python bench/kernel_builds.py [--sandbox bwrap|none] [--json PATH]
"""

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from bench.sibling_kernels import SIBLINGS, Block  # noqa: E402
from torchfarm.compiler.inductor import WORKER_CONFIG  # noqa: E402
from torchfarm.proto import torchfarm_pb2 as pb  # noqa: E402
from torchfarm.settings import WorkerSettings  # noqa: E402
from torchfarm.torch_adapter.compile import standalone  # noqa: E402
from torchfarm.workers import kernel_builder, kernel_cache  # noqa: E402


def recorded_sources() -> list[pb.KernelSource]:
    """The C++ libraries one training step's compile builds, in a throwaway cache dir."""
    depth, mlp = SIBLINGS["A"]
    model = torch.nn.Sequential(*[Block(128, mlp) for _ in range(depth)])
    x = torch.randn(4, 64, 128)
    sources: list[pb.KernelSource] = []
    with tempfile.TemporaryDirectory() as cache, standalone.cache_dir_at(cache):
        with standalone.inductor_config.patch(WORKER_CONFIG), kernel_cache.recording(sources):
            torch.compile(model)(x).sum().backward()
    return sources


def machine_cpu() -> float:
    """Busy CPU seconds of the whole machine (/proc/stat): the builders run in their own PID
    namespace, whose processes no rusage of ours counts. Run it on a quiet machine."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def measure(sources: list[pb.KernelSource], settings: WorkerSettings, burst: bool) -> dict:
    cpu, started = machine_cpu(), time.perf_counter()
    objects = 0
    if burst:
        with kernel_builder._Builder(settings) as builder:
            objects = sum(len(builder.build(s).built) for s in sources)
    else:
        for source in sources:
            with kernel_builder._Builder(settings) as builder:
                objects += len(builder.build(source).built)
    return {
        "wall_s": round(time.perf_counter() - started, 2),
        "cpu_s": round(machine_cpu() - cpu, 2),
        "objects": objects,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sandbox", default="bwrap", choices=("bwrap", "none"))
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    sources = recorded_sources()
    settings = WorkerSettings(sandbox=args.sandbox)
    measure(sources[:1], settings, burst=True)  # the page cache and headers, for both rows
    rows = {
        "one builder per source": measure(sources, settings, burst=False),
        "one builder for the burst": measure(sources, settings, burst=True),
    }
    print(f"{len(sources)} sources, sandbox {args.sandbox}, torch {torch.__version__}")
    print(f"{'':28s} {'wall s':>8s} {'CPU s':>8s} {'objects':>8s}")
    for name, row in rows.items():
        print(f"{name:28s} {row['wall_s']:8.2f} {row['cpu_s']:8.2f} {row['objects']:8d}")
    per, burst = rows["one builder per source"], rows["one builder for the burst"]
    print(
        f"burst / per source: wall {burst['wall_s'] / per['wall_s']:.2f}x, "
        f"CPU {burst['cpu_s'] / per['cpu_s']:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "machine": f"{platform.node()} {os.cpu_count()} cores",
                    "sources": len(sources),
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
