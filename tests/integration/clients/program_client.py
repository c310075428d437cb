"""Run a program of three graphs (two graph breaks) through the farm in a fresh process; print
a JSON line of what happened to each graph.

Usage: program_client.py SCALE SIZE   (TORCHFARM_ADDR / TORCHFARM_TOKEN from the env). SCALE is a
constant of every graph (a test's own keys); SIZE the input's length (another graph, the same
program).
"""

import json
import sys

import torch

from torchfarm.client.backend import history


def step(x: torch.Tensor, scale: float) -> torch.Tensor:
    y = torch.sin(x) * scale
    torch._dynamo.graph_break()
    z = torch.cos(y) + scale
    torch._dynamo.graph_break()
    return torch.relu(z * y - scale).sum()


def main(scale: float, size: int) -> None:
    x = torch.randn(size)
    compiled = torch.compile(lambda t: step(t, scale), backend="torchfarm", dynamic=False)
    out = compiled(x)
    print(
        json.dumps(
            {
                "sources": [r.source for r in history],
                "prefetched": [r.prefetched for r in history],
                "keys": [r.key for r in history],
                "explanations": [r.explanation for r in history],
                "whys": [r.why for r in history],
                "out_err": (out - step(x, scale)).abs().max().item(),
            }
        )
    )


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]))
