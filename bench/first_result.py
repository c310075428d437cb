"""One measurement: time from torch.compile to the first training step's result, in this
(fresh) process. Usage: first_result.py {inductor,torchfarm}. Prints one JSON line."""

import json
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.models import TransformerBlock  # noqa: E402


def main(backend: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(TransformerBlock(128, 4), TransformerBlock(128, 4), nn.LayerNorm(128))
    x = torch.randn(4, 64, 128)
    started = time.perf_counter()
    compiled = torch.compile(model, backend=backend)
    loss = compiled(x).square().mean()
    loss.backward()
    seconds = time.perf_counter() - started
    source, graphs = backend, []
    if backend == "torchfarm":
        from torchfarm.client.backend import history

        source = ",".join(sorted({r.source for r in history}))
        graphs = [r.timings for r in history]
    print(json.dumps({"seconds": seconds, "source": source, "graphs": graphs}))


if __name__ == "__main__":
    main(sys.argv[1])
