"""A 2-rank DDP training job for `torchfarm prepare --world-size 2`
(tests/integration/test_prepare.py).

`first_step` is the job's entry point as its script has it: it joins the job's process group
(torchrun's environment), wraps tests/models.py's BlockMLP in DDP with small buckets
(DDPOptimizer hands the backend one graph per block) and runs one compiled training step.
Run under torchrun, each rank writes OUT_DIR/rank<N>.json: its graphs' sources and the
largest difference of its output and gradients from the same step run eagerly.
"""

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

BUCKET_CAP_MB = 1  # each block's weights are over 1 MiB (DDP's first bucket may not be larger)


def first_step(backend: str | None = "torchfarm") -> list[torch.Tensor]:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model, x = build("blocks")  # the same weights and batch on every rank
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    run = torch.compile(ddp, backend=backend) if backend else ddp
    out = run(x)
    out.sum().backward()
    return [out.detach(), *[p.grad for p in ddp.parameters()]]


if __name__ == "__main__":
    from torchfarm.client.backend import history

    farm = first_step()
    sources = [r.source for r in history]
    torch._dynamo.reset()
    eager = first_step(backend=None)
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(
            {
                "sources": sources,
                "max_diff": max((a - b).abs().max().item() for a, b in zip(farm, eager)),
            },
            f,
        )
    dist.destroy_process_group()
