"""One training step through `torchfarm.compile` (or `torch.compile(..., backend="torchfarm")`)
with TORCHFARM_SKIP_TRACING=1, in a fresh process; prints a JSON line: frames Dynamo traced,
graph sources, errors against eager.

Usage: skip_client.py MODEL [SIZE [ENTRY]]   MODEL: blocks (bench/first_result.py's model),
broken (a graph break), dynamic (an MLP, dynamic shapes); SIZE: blocks' sequence length, else
the batch; ENTRY: torchfarm (torchfarm.compile, the default) or torch (torch.compile with the
backend named by its entry point)
"""

import json
import logging
import os
import sys

import torch
from torch import nn

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
)
import torchfarm  # noqa: E402
from tests.models import TransformerBlock  # noqa: E402
from torchfarm.client.backend import history  # noqa: E402


class Broken(nn.Module):
    """Two graphs: print() breaks the frame between them."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        print("between the graphs", file=sys.stderr)
        return self.b(h).tanh()


def build(name: str, size: int):
    torch.manual_seed(0)
    if name == "blocks":
        model = nn.Sequential(TransformerBlock(128, 4), TransformerBlock(128, 4), nn.LayerNorm(128))
        return model, torch.randn(4, size, 128), None
    if name == "broken":
        return Broken(), torch.randn(size, 32), None
    # dynamic: an MLP whose C++ code guards the batch size (Inductor adds `s0 <= 4096`)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    return model, torch.randn(size, 32), True


def main(name: str, size: int, entry: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    model, x, dynamic = build(name, size)
    expected = model(x)
    expected.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    if entry == "torch":
        compiled = torch.compile(model, backend="torchfarm", dynamic=dynamic)
    else:
        compiled = torchfarm.compile(model, dynamic=dynamic)
    out = compiled(x)
    out.square().mean().backward()
    grad_err = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), grads))
    stats = torch._dynamo.utils.counters["stats"]
    print(
        json.dumps(
            {
                "traced_graphs": stats["unique_graphs"],
                "sources": [r.source for r in history],
                "whys": [r.why[-600:] for r in history],
                "out_err": (out - expected).abs().max().item(),
                "grad_err": grad_err,
            }
        )
    )


if __name__ == "__main__":
    main(
        sys.argv[1],
        int(sys.argv[2]) if len(sys.argv) > 2 else 16,
        sys.argv[3] if len(sys.argv) > 3 else "torchfarm",
    )
