"""Runtime parity in one process: the farm-compiled and the locally compiled model, timed in
alternating rounds on the same weights and inputs; prints one JSON line.

    parity.py MODEL      (TORCHFARM_ADDR from the env)
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client import make_step, rel_err, step_ms  # noqa: E402
from models import build  # noqa: E402


def main(name: str, rounds: int = 5) -> None:
    model, (x,), spec = build(name)
    steps = {"eager": make_step(model, model, spec),
             "farm": make_step(torch.compile(model, backend="torchfarm"), model, spec),
             "local": make_step(torch.compile(model, backend="inductor"), model, spec)}
    results = {k: step(x) for k, step in steps.items()}  # compiles both
    errors = {k: max(rel_err(a, b) for a, b in zip([results[k][0], *results[k][1]],
                                                   [results["local"][0], *results["local"][1]]))
              for k in ("farm", "eager")}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for k, step in steps.items():
            times[k].append(step_ms(step, x))
    from torchfarm.client.backend import history

    farm, local, eager = (statistics.median(times[k]) for k in ("farm", "local", "eager"))
    print(json.dumps({"model": name, "case": "parity (one process)", "farm_ms": round(farm, 3),
                      "local_ms": round(local, 3), "eager_ms": round(eager, 3),
                      "farm_over_local": round(farm / local, 4),
                      "speedup_vs_eager": round(eager / farm, 3),
                      "farm_vs_local_rel_err": errors["farm"], "graphs": [r.source for r in history],
                      "rounds_ms": times}))


if __name__ == "__main__":
    main(sys.argv[1])
