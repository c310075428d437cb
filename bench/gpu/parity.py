"""Runtime parity in one process: the farm-compiled and the locally compiled model, timed in
alternating rounds on the same weights and inputs; prints one JSON line.

The figure is the median over rounds of farm/local measured back to back within a round,
which cancels the drift of clocks and of the host between rounds. GPT's input is larger than
the warm-start rows' (32 x 512 tokens) so that the GPU, not the Python launch loop, sets the
step time; a `coverage:NAME` architecture (client.py) takes its own inputs.

    parity.py MODEL      (TORCHFARM_ADDR from the env; PARITY_ROUNDS, default 12)
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client import build, make_step, rel_err, settle, step_ms  # noqa: E402


def main(name: str, rounds: int) -> None:
    model, xs, spec = build(name)
    if name.startswith("gpt"):
        xs = (xs[0].repeat(2, 2),)  # step_ms calls step(*xs)
    steps = {
        "eager": make_step(model, model, spec),
        "farm": make_step(torch.compile(model, backend="torchfarm"), model, spec),
        "local": make_step(torch.compile(model, backend="inductor"), model, spec),
    }
    results = {k: step(*xs) for k, step in steps.items()}  # compiles both
    settle_s = settle(steps["farm"], xs)  # split graphs (TORCHFARM_REGIONS) on their whole code
    errors = {
        k: max(
            rel_err(a, b)
            for a, b in zip(
                [results[k][0], *results[k][1]], [results["local"][0], *results["local"][1]]
            )
        )
        for k in ("farm", "eager")
    }
    times: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(rounds):  # alternate which compiled model runs first
        for k in ("eager", "farm", "local") if i % 2 else ("eager", "local", "farm"):
            times[k].append(step_ms(steps[k], xs, iters=30))
    from torchfarm.client.backend import history

    ratios = sorted(f / loc for f, loc in zip(times["farm"], times["local"]))
    farm, local, eager = (statistics.median(times[k]) for k in ("farm", "local", "eager"))
    print(
        json.dumps(
            {
                "model": name,
                "case": "parity (one process)",
                "farm_ms": round(farm, 3),
                "local_ms": round(local, 3),
                "eager_ms": round(eager, 3),
                "farm_over_local": round(statistics.median(ratios), 4),
                "ratio_range": [round(ratios[0], 4), round(ratios[-1], 4)],
                "speedup_vs_eager": round(eager / farm, 3),
                "farm_vs_local_rel_err": errors["farm"],
                "settle_s": round(settle_s, 2),
                "graphs": [r.source for r in history],
                "rounds_ms": times,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(os.environ.get("PARITY_ROUNDS", "12")))
