"""Run one model through the farm in a fresh process; print a JSON line of what happened.

Usage: model_client.py MODEL {infer,train}   (TORCHFARM_ADDR / TORCHFARM_TOKEN from the env)
With WAIT_FOR_WHOLE=1, a graph running its regions' code (TORCHFARM_REGIONS) is called
until it has switched to its whole graph's code (at most 300 s), and `settled_err` is that
code's forward against eager.
"""

import json
import os
import sys
import time

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
    settled_err = None
    if os.environ.get("WAIT_FOR_WHOLE") == "1":
        deadline = time.monotonic() + 300
        while not any(r.switched for r in history) and time.monotonic() < deadline:
            compiled(x)
            time.sleep(0.2)
        settled_err = (compiled(x).detach() - expected).abs().max().item()
    counters = torch._dynamo.utils.counters["inductor"]
    print(
        json.dumps(
            {
                "sources": [r.source for r in history],
                "whys": [r.why for r in history],
                "out_err": (out - expected).abs().max().item(),
                "grad_err": grad_err,
                "settled_err": settled_err,
                "local_inductor_compiles": counters["fxgraph_cache_miss"],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
