"""One DDP training step (gloo, one process, world_size 1) through the farm, then the same
step eagerly; prints a JSON line of what happened, with the exact sums of the farm's output
and gradients.

Small DDP buckets make DDPOptimizer hand the backend one graph per block before running any.
Usage: ddp_client.py   (TORCHFARM_ADDR / TORCHFARM_TOKEN from the env)
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
)
from tests.models import build  # noqa: E402
from torchfarm.client.backend import history  # noqa: E402
from torchfarm.local_farm import free_port  # noqa: E402

BUCKET_CAP_MB = 1  # each block's weights are over 1 MiB (DDP's first bucket may not be larger)


def step(model: torch.nn.Module, x: torch.Tensor, backend: str | None):
    """Forward and backward of a DDP copy of `model`; its output and gradients."""
    torch._dynamo.reset()
    ddp = DDP(copy.deepcopy(model), bucket_cap_mb=BUCKET_CAP_MB)
    run = torch.compile(ddp, backend=backend) if backend else ddp
    out = run(x)
    out.sum().backward()
    return out.detach(), [p.grad for p in ddp.parameters()]


def error(a, b) -> float:
    (out_a, grads_a), (out_b, grads_b) = a, b
    return max((u - v).abs().max().item() for u, v in zip([out_a, *grads_a], [out_b, *grads_b]))


def sums(result) -> list[float]:
    out, grads = result
    return [t.double().sum().item() for t in [out, *grads]]


def main() -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    model, x = build("blocks")
    farm = step(model, x, "torchfarm")
    records = list(history)
    eager = step(model, x, None)
    dist.destroy_process_group()
    print(
        json.dumps(
            {
                "records": [
                    {
                        "source": r.source,
                        "deferred": r.deferred,
                        "submitted": r.submitted,
                        "awaited": r.awaited,
                        "why": r.why,
                    }
                    for r in records
                ],
                "eager_err": error(farm, eager),
                "sums": sums(farm),
            }
        )
    )


if __name__ == "__main__":
    main()
