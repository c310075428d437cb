"""Steady-state step time, farm against local, in one process (issue 28's ±3% target).

The timing that both parity benches share (this file's CPU rows and bench/gpu/parity.py):
the farm's and the local step alternate in rounds of one step each, each step timed alone,
Python's collector off; the figure is median(farm) / median(local) with a bootstrap 95%
interval over the rounds.

CPU rows (this file's main): an embedded farm on this machine, then per model a fresh process
that compiles the model's training step through the farm and with local Inductor, checks
both against eager, waits for a quiet machine (the farm's pool builds after a miss share its
cores) and times them. Models: `transformer` (bench/sibling_kernels.py's B) and `mobilenet`
(bench/precompiled_headers.py's MobileNetV3-style net), the CPU novel-miss rows.

    .venv/bin/python bench/step_parity.py [--models transformer,mobilenet] [--rounds 300]
                                          [--orders pairs[,rotate3]] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

# Which step runs after which matters: a step right after an eager one finds the CPU's caches
# full of the eager step's dispatches and launches more slowly (a launch-bound step shows it).
ORDERS = {
    # farm and local alternate as F L L F: each follows the other as often as itself; eager
    # is timed apart, after them
    "pairs": [("farm", "local"), ("local", "farm")],
    # the three rotated, bench/gpu/parity.py's order until 2026-11-27: farm followed an eager
    # step in two rounds of three, local never (kept to show the bias: PARITY_ORDER=rotate3)
    "rotate3": [("eager", "farm", "local"), ("local", "eager", "farm"), ("farm", "local", "eager")],
}


def _timer(device: str) -> Callable[[Callable, tuple], float]:
    """Milliseconds of one call of a step: CUDA events around it on the GPU (synchronized
    after), the host's clock on the CPU."""
    if device != "cuda":

        def host(step: Callable, xs: tuple) -> float:
            started = time.perf_counter()
            step(*xs)
            return (time.perf_counter() - started) * 1000

        return host
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def events(step: Callable, xs: tuple) -> float:
        start.record()
        step(*xs)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    return events


def timed_rounds(
    steps: dict[str, Callable], xs: tuple, rounds: int, orders: list, device: str = "cuda"
) -> dict[str, list[float]]:
    """Milliseconds of each step in `rounds` rounds, round i running one step of each model
    of orders[i % len(orders)] in that order (after five untimed steps of each)."""
    for step in steps.values():
        for _ in range(5):
            step(*xs)
    if device == "cuda":
        torch.cuda.synchronize()
    timed = _timer(device)
    times: dict[str, list[float]] = {k: [] for k in steps}
    gc.collect()
    gc.disable()
    try:
        for i in range(rounds):
            for k in orders[i % len(orders)]:
                times[k].append(timed(steps[k], xs))
    finally:
        gc.enable()
    return times


def ratio_interval(farm: list[float], local: list[float], draws: int = 2000) -> list[float]:
    """Bootstrap 95% interval of median(farm) / median(local), resampling whole rounds."""
    rng = random.Random(0)
    n, ratios = len(farm), []
    for _ in range(draws):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(
            statistics.median(farm[i] for i in picks) / statistics.median(local[i] for i in picks)
        )
    ratios.sort()
    return [round(ratios[int(0.025 * draws)], 4), round(ratios[int(0.975 * draws)], 4)]


def timed_figures(
    steps: dict[str, Callable], xs: tuple, rounds: int, orders: list[str], device: str
) -> tuple[dict[str, list[float]], dict]:
    """The steps (eager, farm, local) timed in each order of `orders` (names in ORDERS); the
    first order's times (eager timed apart where that order leaves it out) and the figures a
    parity row reports: median steps, farm / local with its interval, and in every order."""
    by_order = {o: timed_rounds(steps, xs, rounds, ORDERS[o], device) for o in orders}
    times = by_order[orders[0]]
    if not times["eager"]:
        eager_only = {"eager": steps["eager"]}
        times["eager"] = timed_rounds(eager_only, xs, 50, [("eager",)], device)["eager"]
    farm, local, eager = (statistics.median(times[k]) for k in ("farm", "local", "eager"))
    return times, {
        "farm_ms": round(farm, 4),
        "local_ms": round(local, 4),
        "eager_ms": round(eager, 4),
        "farm_over_local": round(farm / local, 4),
        "interval_95": ratio_interval(times["farm"], times["local"]),
        "rounds": rounds,
        "order": orders[0],
        "farm_over_local_by_order": {
            o: round(statistics.median(t["farm"]) / statistics.median(t["local"]), 4)
            for o, t in by_order.items()
        },
        "speedup_vs_eager": round(eager / farm, 3),
    }


def wait_quiet(busy_cores: float = 1.0, timeout_s: float = 180.0) -> float:
    """Until the processes on this process's CPUs together used less than `busy_cores` CPUs
    over a second (/proc/stat's per-CPU lines; a bench pinned to its own cores, e.g. one
    runner per GPU, waits for its own work only), at most `timeout_s`; the seconds waited."""
    mine = os.sched_getaffinity(0)

    def busy_ticks() -> int:
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if not name.startswith("cpu"):
                    break
                if name != "cpu" and int(name[3:]) in mine:
                    ticks = [int(v) for v in values]
                    busy += sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
        return busy

    started = time.monotonic()
    hz = os.sysconf("SC_CLK_TCK")
    while time.monotonic() - started < timeout_s:
        busy = busy_ticks()
        time.sleep(1.0)
        if (busy_ticks() - busy) / hz < busy_cores:
            break
    return time.monotonic() - started


def cpu_model(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """A CPU novel-miss row's model and input."""
    sys.path.insert(0, HERE)
    torch.manual_seed(0)
    if name == "transformer":
        from sibling_kernels import model

        return model("B"), torch.randn(8, 64, 128)
    if name == "mobilenet":
        from precompiled_headers import model as mobilenet

        return mobilenet(), torch.randn(8, 3, 64, 64)
    raise ValueError(f"unknown CPU parity model {name!r}: transformer or mobilenet")


def _rel_errs(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    """Relative errors of a step's output (a[0]) and of all its gradients as one vector (a
    parameter whose true gradient is 0, as a convolution's bias before a batch norm, holds
    only rounding, so no gradient is compared alone)."""
    grads_a, grads_b = (torch.cat([g.flatten() for g in t[1:]]) for t in (a, b))
    return [
        ((u - v).norm() / v.norm().clamp_min(1e-12)).item()
        for u, v in ((a[0], b[0]), (grads_a, grads_b))
    ]


def measure(name: str, rounds: int, orders: list[str]) -> dict:
    """In a fresh process (TORCHFARM_ADDR set): farm, local and eager training steps of
    `name`, checked against eager, then timed in each of `orders` (the figure: the first)."""
    net, x = cpu_model(name)

    def training_step(fn: Callable) -> Callable:
        def step(x: torch.Tensor) -> list[torch.Tensor]:
            net.zero_grad(set_to_none=True)
            out = fn(x)
            out.square().mean().backward()
            return [out.detach()] + [p.grad for p in net.parameters()]

        return step

    steps = {
        "eager": training_step(net),
        "farm": training_step(torch.compile(net, backend="torchfarm")),
        "local": training_step(torch.compile(net, backend="inductor")),
    }
    results = {k: step(x) for k, step in steps.items()}  # compiles both
    quiet_after_s = wait_quiet()
    _, figures = timed_figures(steps, (x,), rounds, orders, "cpu")
    from torchfarm.client.backend import history

    return {
        "model": name,
        "case": "parity (one process), cpu",
        **figures,
        "farm_vs_local_rel_err": _rel_errs(results["farm"], results["local"]),
        "local_vs_eager_rel_err": _rel_errs(results["local"], results["eager"]),
        "graphs": [r.source for r in history],
        "quiet_after_s": round(quiet_after_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="transformer,mobilenet")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--json", default="")
    parser.add_argument(
        "--orders",
        default="pairs",
        help="pairs, rotate3 or both (pairs,rotate3): the first's figure",
    )
    parser.add_argument("--measure", default="", help=argparse.SUPPRESS)  # the fresh process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.rounds, args.orders.split(","))))
        return
    sys.path.insert(0, os.path.join(HERE, ".."))
    from tests.integration.helpers import wait_for_precompiled_headers
    from torchfarm.gateway.auth import hash_token, make_token
    from torchfarm.local_farm import LocalFarm

    token, rows = make_token(), []
    with LocalFarm(tenants=f"bench:{hash_token(token)}") as farm:
        wait_for_precompiled_headers(farm)  # a farm builds them once, at its start
        for name in args.models.split(","):
            env = dict(
                os.environ,
                TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="parity-inductor-"),
                TORCHFARM_ADDR=farm.addr,
                TORCHFARM_TOKEN=token,
                TORCHFARM_PROGRESS="0",
            )
            out = subprocess.run(
                [sys.executable, __file__, "--measure", name, "--rounds", str(args.rounds)]
                + ["--orders", args.orders],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "torch": torch.__version__,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
