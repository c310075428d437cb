"""Sibling misses on CPU (issue 28): model A, then model B of the same family (one block
deeper, a narrower MLP: layer-norm, attention and projection kernels shared, the MLP's not).
Time to the first training step's result of B, each in a fresh process with an empty local
Inductor cache, side by side in one run:

- local cold: B alone;
- local after A: A, then B in another fresh process with A's local Inductor cache and
  precompiled header kept (what a single user gets today);
- farm miss, empty: B for a tenant whose kernel cache is empty;
- farm miss after A: B for a tenant whose private compile of A filled its kernel cache;
- farm shared miss B after A, other tenant: on a fresh farm, A compiled shared by tenant 1,
  the pool's builds of A's kernel sources left to finish (workers/kernel_builder.py; not
  timed), then B compiled shared by tenant 2;
- farm shared miss B right after A, other tenant (issue 53's sibling row): on a fresh farm
  (headers built, the builders its compiles hand their C++ builds to warm), A compiled shared
  by tenant 1, then at once, nothing waited for, B compiled shared by tenant 2.

Farm requests are private (TORCHFARM_PRIVATE=1) except in the last two rows. Prints a table
and the ratios; `--json PATH` too. `--novel-only`: local cold B and the farm's miss of B on an
empty farm (a novel miss). `--right-after-only`: local cold B and the last row.

    .venv/bin/python bench/sibling_kernels.py [--repeats 1] [--novel-only | --right-after-only]
        [--json PATH]
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
from tests.integration.helpers import (  # noqa: E402
    kernel_log,
    pool_builds,
    wait_for_compile_builders,
    wait_for_pool_builds,
    wait_for_precompiled_headers,
)

SIBLINGS = {"A": (2, 512), "B": (3, 384)}  # depth, MLP width; model width 128, 4 heads
RIGHT_AFTER_A = "farm shared miss A, tenant 1, fresh farm"
RIGHT_AFTER = "farm shared miss B right after A, tenant 2"


class Block(nn.Module):
    def __init__(self, width: int, mlp: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp), nn.GELU(), nn.Linear(mlp, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, 4, c // 4).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


def model(name: str) -> nn.Module:
    depth, mlp = SIBLINGS[name]
    return nn.Sequential(*[Block(128, mlp) for _ in range(depth)], nn.LayerNorm(128))


def step(backend: str, name: str) -> None:
    """In a fresh process: one compiled training step of model `name`; print its seconds,
    where its code came from and its loss's difference from eager."""
    torch.manual_seed(0)
    net, x = model(name), torch.randn(8, 64, 128)
    expected = net(x).square().mean().item()
    started = time.perf_counter()
    loss = torch.compile(net, backend=backend)(x).square().mean()
    loss.backward()
    seconds = time.perf_counter() - started
    source, phases = backend, {}
    if backend == "torchfarm":
        from torchfarm.client.backend import history

        source = ",".join(sorted({r.source for r in history}))
        for record in history:  # the graphs' phases, added up
            for phase, value in record.timings.items():
                phases[phase] = phases.get(phase, 0.0) + value
    error = abs(loss.item() - expected)
    print(json.dumps({"seconds": seconds, "source": source, "error": error, "phases": phases}))


def local_caches(scratch: str) -> dict[str, str]:
    """An empty local Inductor cache and temporary dir (where the precompiled header goes)."""
    return dict(
        TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-", dir=scratch),
        TMPDIR=tempfile.mkdtemp(prefix="tmp-", dir=scratch),
    )


def measure(
    backend: str,
    name: str,
    caches: dict[str, str],
    addr: str = "",
    token: str = "",
    private: bool = True,
):
    env = dict(
        os.environ,
        **caches,
        TORCHFARM_ADDR=addr,
        TORCHFARM_TOKEN=token,
        TORCHFARM_PRIVATE="1" if private else "0",
        TORCHFARM_PROGRESS="0",
    )
    out = subprocess.run(
        [sys.executable, __file__, "--step", backend, name],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def farm_miss(farm, scratch: str, name: str, tenant: str, private: bool = True) -> dict:
    """Model `name` compiled by `farm` for `tenant` in a fresh process with empty caches."""
    from tests.integration.helpers import TOKENS

    caches = local_caches(scratch)
    return measure("torchfarm", name, caches, farm.addr, TOKENS[tenant], private)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", default="")
    parser.add_argument(
        "--novel-only",
        action="store_true",
        help="local cold B and the farm's miss of B on an empty farm only (a novel miss)",
    )
    parser.add_argument(
        "--right-after-only",
        action="store_true",
        help="local cold B and the shared miss of B right after A's (issue 53's row) only",
    )
    parser.add_argument("--step", default="")
    parser.add_argument("name", nargs="?", default="")
    args = parser.parse_args()
    if args.step:
        step(args.step, args.name)
        return
    scratch = tempfile.mkdtemp(prefix="sibling-bench-")
    try:
        measure_all(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def measure_all(args: argparse.Namespace, scratch: str) -> None:
    from tests.integration.helpers import TOKENS
    from torchfarm.gateway.auth import hash_token
    from torchfarm.local_farm import LocalFarm

    runs: dict[str, list[float]] = {}
    print(f"load average at the start {' '.join(f'{v:.2f}' for v in os.getloadavg())}")

    def add(name: str, result: dict, source: str) -> None:
        assert result["source"] == source and result["error"] < 1e-3, (name, result)
        runs.setdefault(name, []).append(result["seconds"])
        phases = ", ".join(f"{k} {v:.1f}" for k, v in result["phases"].items() if k.endswith("_s"))
        print(f"  {name}: {result['seconds']:.1f} s ({result['source']}) {phases}", flush=True)

    for _ in range(args.repeats):
        add("local cold B", measure("inductor", "B", local_caches(scratch)), "inductor")
        if args.novel_only or args.right_after_only:
            continue
        kept = local_caches(scratch)  # A's cache and header, kept for B's fresh process
        add("local A", measure("inductor", "A", kept), "inductor")
        add("local B after A", measure("inductor", "B", kept), "inductor")
    tenants = ",".join(f"{name}:{hash_token(tok)}" for name, tok in TOKENS.items())
    for _ in range(args.repeats):
        if not args.novel_only:
            with LocalFarm(tenants=tenants) as farm:  # the pool's kernels, nothing waited for
                wait_for_precompiled_headers(farm)
                wait_for_compile_builders(farm)  # a farm up for a few seconds more
                add(RIGHT_AFTER_A, farm_miss(farm, scratch, "A", "alice", False), "miss")
                add(RIGHT_AFTER, farm_miss(farm, scratch, "B", "bob", False), "miss")
                print("  worker:", *kernel_log(farm), sep="\n    ")
        if args.right_after_only:
            continue
        with LocalFarm(tenants=tenants) as farm:  # a fresh farm each time: empty caches
            wait_for_precompiled_headers(farm)
            add("farm miss B, empty", farm_miss(farm, scratch, "B", "bob"), "miss")
            if args.novel_only:
                continue
            add("farm miss A", farm_miss(farm, scratch, "A", "alice"), "miss")
            add("farm miss B after A", farm_miss(farm, scratch, "B", "alice"), "miss")
            print("  worker:", *kernel_log(farm), sep="\n    ")
        with LocalFarm(tenants=tenants) as farm:  # the pool's kernels, across tenants
            wait_for_precompiled_headers(farm)
            builds = pool_builds(farm)
            shared_a = farm_miss(farm, scratch, "A", "alice", False)
            add("farm shared miss A, tenant 1", shared_a, "miss")
            started = time.perf_counter()
            wait_for_pool_builds(farm, builds)
            print(f"  pool builds of A's sources: {pool_builds(farm)[1]} in", end=" ")
            print(f"{time.perf_counter() - started:.0f} s after A's step", flush=True)
            shared_b = farm_miss(farm, scratch, "B", "bob", False)
            add("farm shared miss B after A, tenant 2", shared_b, "miss")
            print("  worker:", *kernel_log(farm), sep="\n    ")
    medians = {k: statistics.median(v) for k, v in runs.items()}
    print(f"\n{platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}", end=", ")
    print(f"load average at the end {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print("| case | seconds |\n|---|---|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(medians, f, indent=1)
    cold = medians["local cold B"]
    for row in ("farm miss B, empty", RIGHT_AFTER, RIGHT_AFTER_A):
        if row in medians:
            print(f"{row} / local cold B: {medians[row] / cold:.2f}")
    if args.novel_only or args.right_after_only:
        return
    after = medians["farm miss B after A"]
    print(f"farm miss B after A / local cold B: {after / cold:.2f}")
    print(f"farm miss B after A / local B after A: {after / medians['local B after A']:.2f}")
    print(f"farm miss B after A / farm miss B, empty: {after / medians['farm miss B, empty']:.2f}")
    shared = medians["farm shared miss B after A, tenant 2"]
    print(f"farm shared miss B after A (tenant 2) / local cold B: {shared / cold:.2f}")
    print(
        "farm shared miss B after A (tenant 2) / local B after A: "
        f"{shared / medians['local B after A']:.2f}"
    )


if __name__ == "__main__":
    main()
