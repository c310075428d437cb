"""A DDP job's first step as rank 0 of 2 with no peers (torch_adapter/trace/fake_ranks.py), on
fake tensors as `torchfarm prepare` runs it: DDPOptimizer hands the backend one graph per
bucket, as on every real rank; the job's own init_process_group and comm hook calls are
absorbed; afterwards nothing of it is left (no process group, environment, DDP as it was)."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.models import build
from torchfarm.torch_adapter.trace.fake_ranks import fake_ranks
from torchfarm.torch_adapter.trace.fake_tensors import FakeTensorMode


def _state():
    return (
        dist.is_initialized(),
        {n: os.environ.get(n) for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
        DDP.__dict__["__init__"],
        DDP.__dict__["register_comm_hook"],
    )


def _graphs_of_a_ddp_step() -> int:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    dist.init_process_group("gloo")  # the job's own call, under torchrun
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, x = build("blocks")
        ddp = DDP(model, bucket_cap_mb=1)
        ddp.register_comm_hook(None, lambda state, bucket: None)  # the job's own hook
        out = torch.compile(ddp, backend=capture)(x)
        out.sum().backward()  # through the reducer, which hands the buckets back
    torch._dynamo.reset()
    return len(graphs)


def test_rank_0_of_2_traces_a_graph_per_bucket_and_leaves_nothing_behind():
    before = _state()
    with fake_ranks(2):
        assert dist.get_world_size() == 2 and dist.get_rank() == 0
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "2")
        assert _graphs_of_a_ddp_step() == 6  # BlockMLP: one bucket per block
    assert _state() == before


def test_one_rank_changes_nothing_and_a_live_group_is_refused():
    before = _state()
    with fake_ranks(1):
        assert _state() == before
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="process of its own"), fake_ranks(2):
            pass
    finally:
        dist.destroy_process_group()
