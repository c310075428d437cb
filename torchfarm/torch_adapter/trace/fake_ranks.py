"""A data-parallel job's first step as its rank 0, with no peers: `torchfarm prepare
--world-size N`.

DDP hands the backend one graph per bucket (DDPOptimizer), and which graphs those are depends
on the model and `bucket_cap_mb`, not on the rank: rank 0's graphs are every rank's. While
`fake_ranks(N)` is entered:
- a process group of N ranks that communicates nothing is the default group (PyTorch's
  "fake" backend and FakeStore, which TorchTitan's dry runs use too), and the job's own
  `dist.init_process_group(...)` call finds it there: the call is absorbed;
- RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE say rank 0 of N, as torchrun would;
- DDP's constructor skips the two steps that read parameter data from peers
  (`_verify_param_shape_across_processes`, `_sync_module_states`: the parameters are fake
  tensors and there are no peers), and each DDP gets a comm hook that hands its buckets back
  as reduced (the fake group's all-reduce gives no tensor back). The job's own comm hooks
  are ignored: they run between graphs, in the backward, and change none of them.

Uses torch.testing._internal.distributed.fake_pg.FakeStore (it registers the "fake"
backend), torch.nn.parallel.distributed's module-level `_verify_param_shape_across_processes`
and `_sync_module_states`, and DistributedDataParallel.__init__ / register_comm_hook /
_register_builtin_comm_hook (torch 2.11-2.15)."""

# No `from __future__ import annotations`: DDP checks the comm hook's return annotation.
import contextlib
import os
from collections.abc import Iterator
from unittest import mock

import torch


def _nothing(*args, **kwargs) -> None:
    return None


def _handed_back(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """A comm hook: the bucket's gradients, as if all-reduced among ranks that agree."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


@contextlib.contextmanager
def fake_ranks(world_size: int) -> Iterator[None]:
    """Run the block as rank 0 of `world_size` ranks with no peers (1: nothing changes)."""
    if world_size <= 1:
        yield
        return
    import torch.distributed as dist
    from torch.nn.parallel import distributed as ddp_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already initialized here: prepare a data-parallel job in a "
            "process of its own"
        )
    ddp = ddp_module.DistributedDataParallel
    original_init, register_hook = ddp.__init__, ddp.register_comm_hook

    def init(self, *args, **kwargs) -> None:
        original_init(self, *args, **kwargs)
        register_hook(self, None, _handed_back)

    patched = [
        (dist, "init_process_group", _nothing),
        (ddp_module, "_verify_param_shape_across_processes", _nothing),
        (ddp_module, "_sync_module_states", _nothing),
        (ddp, "__init__", init),
        (ddp, "register_comm_hook", _nothing),
        (ddp, "_register_builtin_comm_hook", _nothing),
    ]
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    }
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with contextlib.ExitStack() as restored:
            restored.enter_context(mock.patch.dict(os.environ, env))
            for owner, name, value in patched:
                restored.enter_context(mock.patch.object(owner, name, value))
            yield
    finally:
        dist.destroy_process_group()
