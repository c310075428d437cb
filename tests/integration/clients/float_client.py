"""A function of a Python float global through the farm in a fresh process: called with 1.0,
then with VALUE (Dynamo lifts the changed float to a 0-d tensor input read with .item()), then
with VALUE + 1.25 (the same graph reads it at run time); prints a JSON line: the graphs' sources
and keys, Dynamo's graph count, and the largest error against eager.

Usage: float_client.py VALUE   (TORCHFARM_ADDR / TORCHFARM_TOKEN from the env)
"""

import json
import os
import sys

import torch

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
)
from torchfarm.client.backend import history  # noqa: E402

scale = 1.0


def scaled(x):
    return (x * scale).sin() + scale


def main(value: float) -> None:
    global scale
    compiled = torch.compile(scaled, backend="torchfarm")
    x = torch.randn(16)
    errors = []
    for scale in (1.0, value, value + 1.25):  # noqa: B007 (the global `scaled` reads)
        errors.append((compiled(x) - scaled(x)).abs().max().item())
    print(
        json.dumps(
            {
                "sources": [r.source for r in history],
                "keys": [r.key for r in history],
                "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                "out_err": max(errors),
            }
        )
    )


if __name__ == "__main__":
    main(float(sys.argv[1]))
