"""A small training loop compiled through the farm; prints one JSON line with what happened.

TORCHFARM_ADDR=host:port python examples/train.py
"""

import copy
import json
import time

import torch
from torch import nn

import torchfarm
from torchfarm.client.backend import history


class Net(nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(32, dim),
            nn.GELU(),
            nn.LayerNorm(dim),
            nn.Linear(dim, dim),
            nn.GELU(),
            nn.Linear(dim, 10),
        )

    def forward(self, x):
        return self.body(x)


def main(steps: int = 5) -> None:
    torch.manual_seed(0)
    eager = Net()
    model = copy.deepcopy(eager)
    compiled = torchfarm.compile(model)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    data = [(torch.randn(16, 32), torch.randint(0, 10, (16,))) for _ in range(steps)]
    started = time.perf_counter()
    first_step_s = None
    max_err = 0.0
    for x, y in data:
        for net, opt, fwd in ((model, opt_c, compiled), (eager, opt_e, eager)):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(fwd(x), y)
            loss.backward()
            opt.step()
            if net is model:
                compiled_loss = loss.item()
                if first_step_s is None:
                    first_step_s = time.perf_counter() - started
            else:
                max_err = max(max_err, abs(compiled_loss - loss.item()))
    params_err = max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), eager.parameters())
    )
    print(
        json.dumps(
            {
                "sources": [r.source for r in history],
                "first_step_s": round(first_step_s, 3),
                "max_loss_err": max_err,
                "max_param_err": params_err,
                "matches_eager": max_err < 1e-4 and params_err < 1e-4,
            }
        )
    )


if __name__ == "__main__":
    main()
