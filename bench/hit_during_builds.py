"""A hit while the pool's kernel builds run (issue 53, item 4), on an embedded CPU farm: does
the worker's background work slow the user's next process?

Each repeat, on one LocalFarm (real Redis, Celery, gRPC, Inductor; the builds share the host's
cores with the client, as with `torchfarm up`): a shared miss of a small transformer's training
step (a width no earlier repeat used, so its C++ sources are new to the pool and the worker
queues their builds once the job has ended; on a CPU pool the compile has the pool build most
of them while it runs, workers/kernel_builder.py CompileBuilds, and only the rest are queued),
then at once a hit in a fresh process (the builds queued or running), then, once every build
is done, another hit in a fresh process.
Each process has an empty local Inductor cache; its time is the whole process's (start-up,
imports, eager warm-up, the compiled step), as a user waits for it. A first repeat warms the
farm up and is not counted: in the first runs the farm's first hit, right after its first
miss, took ~2x the next with no build done yet. Prints each repeat, the
medians, the ratio hit-during-builds / hit-after-builds, the builds and the load average;
`--json PATH` too.

    .venv/bin/python bench/hit_during_builds.py [--repeats 3] [--json PATH]
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

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from tests.integration.helpers import (  # noqa: E402
    TOKENS,
    pool_builds,
    wait_for_pool_builds,
    wait_for_precompiled_headers,
)


def step(width: int) -> None:
    """In a fresh process: one compiled training step of the model of `width`; print its
    seconds, where its code came from and its loss's difference from eager."""
    import torch

    from bench.sibling_kernels import Block
    from torchfarm.client.backend import history

    torch.manual_seed(0)
    net = torch.nn.Sequential(Block(width, 4 * width), Block(width, 4 * width))
    x = torch.randn(8, 64, width)
    expected = net(x).square().mean().item()
    started = time.perf_counter()
    loss = torch.compile(net, backend="torchfarm")(x).square().mean()
    loss.backward()
    seconds = time.perf_counter() - started
    source = ",".join(sorted({r.source for r in history}))
    print(json.dumps({"seconds": seconds, "source": source, "error": abs(loss.item() - expected)}))


def run_step(width: int, addr: str, scratch: str) -> dict:
    """The step in a fresh process with empty local caches; its result and the process's
    wall seconds."""
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-", dir=scratch),
        TMPDIR=tempfile.mkdtemp(prefix="tmp-", dir=scratch),
        TORCHFARM_ADDR=addr,
        TORCHFARM_TOKEN=TOKENS["alice"],
        TORCHFARM_PRIVATE="0",  # shared: its sources are queued for the pool's builds
        TORCHFARM_PROGRESS="0",
    )
    started, cpu = time.perf_counter(), cpu_by_process()
    with subprocess.Popen(
        [sys.executable, __file__, "--step", str(width)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    ) as process:
        out, _ = process.communicate()
    assert process.returncode == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - started
    result["beside"] = busiest(cpu, cpu_by_process(), process.pid)
    assert result["error"] < 1e-3, result
    return result


def cpu_by_process() -> dict[tuple[int, str], float]:
    """CPU seconds of every process now (its own and its reaped children's), by (pid, name)."""
    seconds = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
        except (OSError, ValueError):
            continue
        ticks = sum(int(v) for v in tail.split()[11:15])  # utime stime cutime cstime
        seconds[(int(entry), head.split("(", 1)[1])] = ticks / os.sysconf("SC_CLK_TCK")
    return seconds


def busiest(before: dict, after: dict, skip: int, top: int = 4) -> str:
    """What else took CPU between two `cpu_by_process` readings (but the process `skip`, the
    hit's, and this one, which reaped it): the `top` processes, CPU seconds each. Machine-wide:
    other users' too."""
    spent = [(after[k] - before.get(k, 0.0), k) for k in after if k[0] not in (skip, os.getpid())]
    spent = sorted((s, k) for s, k in spent if s >= 0.1)[::-1][:top]
    return ", ".join(f"{name}[{pid}] {s:.1f}" for s, (pid, name) in spent)


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def repeat(farm, width: int, scratch: str) -> dict:
    before = pool_builds(farm)
    miss = run_step(width, farm.addr, scratch)
    assert miss["source"] == "miss", miss
    at_hit = pool_builds(farm)
    during = run_step(width, farm.addr, scratch)
    assert during["source"] == "hit", during
    after_hit = pool_builds(farm)
    wait_for_pool_builds(farm, before)
    done = pool_builds(farm)
    after = run_step(width, farm.addr, scratch)
    assert after["source"] == "hit", after
    row = {
        "width": width,
        "miss_s": miss["process_s"],
        "hit_during_s": during["process_s"],
        "hit_after_s": after["process_s"],
        "hit_during_step_s": during["seconds"],
        "hit_after_step_s": after["seconds"],
        "builds": done[1] - before[1],
        "builds_done_when_hit_started": at_hit[1] - before[1],
        "builds_done_when_hit_ended": after_hit[1] - before[1],
        "load": load(),
        "beside_hit_during": during["beside"],
        "beside_hit_after": after["beside"],
    }
    print(
        f"  width {width}: miss {row['miss_s']:.1f} s, hit during builds {row['hit_during_s']:.1f}"
        f" s (step {row['hit_during_step_s']:.1f}), hit after {row['hit_after_s']:.1f} s (step "
        f"{row['hit_after_step_s']:.1f}); ratio {row['hit_during_s'] / row['hit_after_s']:.2f}; "
        f"{row['builds']} pool builds ({row['builds_done_when_hit_started']} done when the hit "
        f"started, {row['builds_done_when_hit_ended']} when it ended); load {row['load']}\n"
        f"    CPU s beside the hit during builds: {row['beside_hit_during']}\n"
        f"    CPU s beside the hit after builds: {row['beside_hit_after']}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="")
    parser.add_argument("--step", type=int, default=0, help="(internal) one step, this width")
    args = parser.parse_args()
    if args.step:
        step(args.step)
        return
    from torchfarm.gateway.auth import hash_token
    from torchfarm.local_farm import LocalFarm

    scratch = tempfile.mkdtemp(prefix="hit-during-builds-")
    tenants = ",".join(f"{name}:{hash_token(tok)}" for name, tok in TOKENS.items())
    started_load = load()
    try:
        with LocalFarm(tenants=tenants) as farm:
            wait_for_precompiled_headers(farm)
            print("warm-up (not counted: the farm's first miss and hit start its paths)")
            repeat(farm, 64, scratch)
            rows = [repeat(farm, 96 + 32 * r, scratch) for r in range(args.repeats)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    during = statistics.median(r["hit_during_s"] for r in rows)
    after = statistics.median(r["hit_after_s"] for r in rows)
    ratios = [r["hit_during_s"] / r["hit_after_s"] for r in rows]
    print(f"\n{platform.node()}, {os.cpu_count()} cores; load average at the start {started_load}")
    print(f"median hit during builds {during:.1f} s, after builds {after:.1f} s")
    print(f"hit during builds / hit after builds: median of ratios {statistics.median(ratios):.2f}")
    print(f"pool builds per miss: {[r['builds'] for r in rows]}; load average now {load()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_at_start": started_load, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
