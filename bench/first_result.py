"""One measurement: time from torch.compile to the first training step's result, in this
(fresh) process. Usage: first_result.py {inductor,torchfarm,eager}. Prints one JSON line:
`seconds`, the graphs' `source`, and for torchfarm each graph's timings (GraphRecord
.timings: where a miss or a hit spent its time) and `backend_s`, the seconds from each
graph's submission until its code was ready, summed; for every backend, Dynamo's own
account of its compile (`compile_s`) and the backend's part of it (`backend_compile_s`).
BENCH_MODEL=big measures a larger model (8 blocks of width 256) than the default (2 blocks
of width 128)."""

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
    if os.environ.get("BENCH_MODEL") == "big":
        model = nn.Sequential(*[TransformerBlock(256, 8) for _ in range(8)], nn.LayerNorm(256))
        x = torch.randn(4, 128, 256)
    else:
        model = nn.Sequential(TransformerBlock(128, 4), TransformerBlock(128, 4), nn.LayerNorm(128))
        x = torch.randn(4, 64, 128)
    started = time.perf_counter()
    compiled = torch.compile(model, backend=backend)
    loss = compiled(x).square().mean()
    loss.backward()
    seconds = time.perf_counter() - started
    # Dynamo's own account: its frame compiles (`compile_s`), of which the backend's share
    # (`backend_compile_s`: a farm fetch and load, or Inductor); outside both are the run and
    # first-use costs.
    metrics = torch._dynamo.utils.compilation_time_metrics
    report: dict = {
        "seconds": seconds,
        "source": backend,
        "graphs": [],
        "compile_s": sum(metrics.get("_compile.compile_inner", [])),
        "backend_compile_s": sum(metrics.get("OutputGraph.call_user_compiler", [])),
    }
    if backend == "torchfarm":
        from torchfarm.client.backend import history

        report["source"] = ",".join(sorted({r.source for r in history}))
        report["graphs"] = [r.timings for r in history]
        report["backend_s"] = sum(r.seconds for r in history)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
