"""Run one model through the farm in a fresh process; print a JSON line of what happened.

Usage: model_client.py MODEL {infer,train}   (TORCHFARM_ADDR / TORCHFARM_TOKEN from the env)
"""

import json
import os
import sys

import torch

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
)
from tests.models import build  # noqa: E402
from torchfarm.client.backend import history  # noqa: E402


def main(name: str, mode: str) -> None:
    model, x = build(name)
    compiled = torch.compile(model, backend="torchfarm")
    if mode == "train":
        model.train()
        expected = model(x)
        expected.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        out = compiled(x)
        out.sum().backward()
        grad_err = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), grads))
    else:
        model.eval()
        with torch.no_grad():
            expected, out = model(x), compiled(x)
        grad_err = 0.0
    counters = torch._dynamo.utils.counters["inductor"]
    print(
        json.dumps(
            {
                "sources": [r.source for r in history],
                "whys": [r.why for r in history],
                "out_err": (out - expected).abs().max().item(),
                "grad_err": grad_err,
                "local_inductor_compiles": counters["fxgraph_cache_miss"],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
