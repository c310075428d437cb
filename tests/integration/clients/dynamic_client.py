"""A dynamic-shape MLP ("mlp12", compiled by no other test) through the farm in a fresh
process, first called with batch BATCH;
prints a JSON line: the graphs' sources and keys, and the error against eager.

Usage: dynamic_client.py BATCH   (TORCHFARM_ADDR / TORCHFARM_TOKEN from the env)
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


def main(batch: int) -> None:
    model, _ = build("mlp12")
    x = torch.randn(batch, 32)
    # Grad enabled: then Inductor's C++ code guards the batch size (<= 4096 or > 4096).
    out, expected = torch.compile(model, backend="torchfarm", dynamic=True)(x), model(x)
    print(
        json.dumps(
            {
                "sources": [r.source for r in history],
                "keys": [r.key for r in history],
                "out_err": (out - expected).abs().max().item(),
            }
        )
    )


if __name__ == "__main__":
    main(int(sys.argv[1]))
