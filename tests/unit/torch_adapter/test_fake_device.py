"""Fake tensors on a device this CPU-only torch cannot run, and payload bytes equal to a real
trace's (the property `torchfarm prepare` rests on: same bytes, same key)."""

import torch
from torch import nn

from torchfarm.compiler import serialize
from torchfarm.torch_adapter.trace.fake_device import as_traced_for_real, fake_device
from torchfarm.torch_adapter.trace.fake_tensors import FakeTensor, FakeTensorMode


def test_fake_tensors_move_to_cuda_and_take_random_fills_without_cuda():
    assert not torch.cuda.is_available()
    original_to = torch.Tensor.to
    with FakeTensorMode(), fake_device():
        model = nn.Linear(4, 4).to("cuda")
        assert model.weight.device.type == "cuda" and isinstance(model.weight, nn.Parameter)
        assert model.weight.requires_grad
        x = torch.randn(2, 4).cuda()
        filled = torch.empty(3, device="cuda").uniform_()
        assert isinstance(x, FakeTensor) and x.device.type == "cuda"
        assert filled.device.type == "cuda"
        with torch.no_grad():  # autograd on fake CUDA needs a CUDA build (CUDA's device guard)
            assert model(x).device.type == "cuda"
    assert torch.Tensor.to is original_to  # patches end with the block


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        return (x + self.proj(self.norm(x))).relu().sum()


def _payloads(fake: bool, dynamic: bool) -> list[bytes]:
    got: list[bytes] = []

    def backend(gm, example_inputs):
        if fake:
            as_traced_for_real(gm)
        got.append(serialize.dumps(gm))
        return gm.forward

    def step():
        model = _Net()
        loss = torch.compile(model, backend=backend, dynamic=dynamic)(torch.randn(4, 8))
        loss.backward()

    torch._dynamo.reset()
    if fake:
        with FakeTensorMode(allow_non_fake_inputs=True), fake_device():
            step()
    else:
        step()
    torch._dynamo.reset()
    return got


def test_a_trace_on_fake_tensors_gives_the_payload_of_a_real_trace():
    for dynamic in (False, True):
        real = _payloads(fake=False, dynamic=dynamic)
        assert real and _payloads(fake=True, dynamic=dynamic) == real


def test_cuda_autocast_stays_on_for_a_cuda_target_without_cuda():
    with FakeTensorMode(), fake_device("9.0"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.is_autocast_enabled("cuda")
    with FakeTensorMode(), fake_device("7.0"):  # no bf16 before compute capability 8.0
        try:
            torch.autocast("cuda", dtype=torch.bfloat16)
        except RuntimeError as e:
            assert "bfloat16" in str(e)
        else:
            raise AssertionError("bf16 autocast accepted for compute capability 7.0")
    with torch.autocast("cuda", dtype=torch.bfloat16):  # and off again after the block
        assert not torch.is_autocast_enabled("cuda")


def test_dynamo_sees_the_fused_sdpa_layout_a_gpu_of_the_target_gives():
    """A GPU's fused kernel lays its output out as the query, here (B, L, H, E) transposed to
    (B, H, L, E) as attention layers do; the math fallback that a torch without CUDA runs
    returns it contiguous. Dynamo's example value must be the GPU's (it is in the payload)."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(
            n.meta["example_value"].stride()
            for n in gm.graph.nodes
            if n.target is torch.nn.functional.scaled_dot_product_attention
        )
        return gm.forward

    def attention(q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    torch._dynamo.reset()
    with FakeTensorMode(allow_non_fake_inputs=True), fake_device("9.0"), torch.no_grad():
        q = torch.empty(2, 16, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        torch.compile(attention, backend=backend)(q)
    torch._dynamo.reset()
    assert seen == [(4096, 64, 256, 1)], seen
