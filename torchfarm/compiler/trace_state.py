"""The global state a graph was traced under (grad mode, autocast, matmul precision).

Dynamo guards on this state and calls the backend inside it; AOTAutograd and Inductor then
trace under it: no_grad gives an inference graph, autocast inserts casts. The client
records it with the graph, the key includes it, and the worker compiles inside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from torchfarm.contract.options import AUTOCAST_DEVICES, validate_state
from torchfarm.proto import torchfarm_pb2 as pb


def capture() -> pb.TraceState:
    """This thread's current state (the client calls it inside the backend)."""
    return pb.TraceState(
        grad_enabled=torch.is_grad_enabled(),
        autocast=[
            f"{device}:{str(torch.get_autocast_dtype(device)).removeprefix('torch.')}"
            for device in AUTOCAST_DEVICES
            if torch.is_autocast_enabled(device)
        ],
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
    )


@contextlib.contextmanager
def applied(state: pb.TraceState) -> Iterator[None]:
    """Run the block under `state` (the worker child compiles inside it)."""
    validate_state(state)
    saved_precision = torch.get_float32_matmul_precision()
    saved_deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        torch.set_float32_matmul_precision(state.float32_matmul_precision or "highest")
        torch.use_deterministic_algorithms(state.deterministic_algorithms)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(state.grad_enabled))
            for entry in state.autocast:
                device, _, dtype = entry.partition(":")
                stack.enter_context(torch.autocast(device, getattr(torch, dtype)))
            yield
    finally:
        torch.set_float32_matmul_precision(saved_precision)
        torch.use_deterministic_algorithms(saved_deterministic)
