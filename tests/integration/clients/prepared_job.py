"""A small training job for `torchfarm prepare` (tests/integration/test_prepare.py).

`first_step` is the job's entry point as a user writes it: it builds the model, moves it to
its device and runs one compiled training step (two graphs: a graph break between the
blocks). Run as a script, it is the job's real first process: prints a JSON line with each
graph's source, and the largest difference from the same step run eagerly.
"""

import json
import os
import sys

import torch
from torch import nn

DEVICE = "cpu"


class Net(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.a = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
        self.b = nn.Linear(width, 3)

    def forward(self, x):
        x = x + self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


def step(model, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss


def first_step(compiled: bool = True):
    torch.manual_seed(0)
    model = Net().to(DEVICE)
    x = torch.randn(8, 16, device=DEVICE)
    y = torch.randint(0, 3, (8,), device=DEVICE)
    run = torch.compile(step, backend="torchfarm") if compiled else step
    return run(model, x, y).detach(), [p.grad for p in model.parameters()]


if __name__ == "__main__":
    sys.path.insert(
        0,
        os.path.dirname(
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        ),
    )
    from torchfarm.client.backend import history

    farm_loss, farm_grads = first_step()
    eager_loss, eager_grads = first_step(compiled=False)
    diffs = [
        (a - b).abs().max().item()
        for a, b in zip([farm_loss, *farm_grads], [eager_loss, *eager_grads])
    ]
    print(json.dumps({"sources": [r.source for r in history], "max_diff": max(diffs)}))
