"""The trace state: captured from the client's context, re-entered by the worker child."""

import torch

from torchfarm.compiler import trace_state
from torchfarm.proto import torchfarm_pb2 as pb


def test_capture_sees_no_grad_and_autocast():
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        state = trace_state.capture()
    assert not state.grad_enabled and list(state.autocast) == ["cpu:bfloat16"]
    assert trace_state.capture().grad_enabled


def test_applied_restores_what_it_changed():
    state = pb.TraceState(
        grad_enabled=False, autocast=["cpu:bfloat16"], float32_matmul_precision="medium"
    )
    with trace_state.applied(state):
        assert trace_state.capture() == state
        x = torch.randn(4, 4)
        assert (x @ x).dtype == torch.bfloat16
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    assert torch.get_float32_matmul_precision() == "highest"
