"""Fake tensors on a device this torch build cannot run (for `torchfarm prepare`).

A CPU-only build, or a CUDA build on a machine with no GPU, makes fake CUDA tensors, but:
- `Tensor.to`/`Tensor.cuda` initialise the device's runtime in the Python binding, before any
  dispatch ("PyTorch is not linked with support for cuda devices"): a fake tensor moved to
  such a device becomes an empty fake one there, with its size and strides;
- in-place random fills (`uniform_`, which `nn.init` uses) decompose into an op that asks for
  the device's generator: on a fake tensor they do nothing (its values are never read);
- `Module._apply` swaps a fake parameter for its converted copy, which fails (the fake-tensor
  converter holds a weak reference to it): parameters and buffers are replaced instead, as
  torch's `overwrite_module_params_on_conversion` does;
- `torch.autocast("cuda")` turns itself off where CUDA is not available (a bf16 step would be
  traced in fp32): for a CUDA target it is told CUDA is there, and bf16 is supported where
  the target's compute capability has it (8.0 and later);
- scaled_dot_product_attention picks its kernel in C++ from the device's properties (no
  dispatcher op a mode could answer); without the device it runs the math fallback, whose
  output is laid out otherwise than a fused kernel's, so the graph's bytes (Dynamo's example
  values) would differ from the job's. For a CUDA target, Dynamo's fake run of an SDPA node
  (`torch._dynamo.utils.run_node`) calls the fused kernel the target would pick instead:
  flash for fp16/bf16 at compute capability 8.0 or later with head dims up to 256, else
  memory-efficient, for head dims that are multiples of 8, within what
  `torch.backends.cuda.*_sdp_enabled` allows; math otherwise. This is torch's rule in
  outline only: where it picks otherwise the job's graph misses (and compiles, correctly);
  it never runs wrong code. The graph's own code still runs the math fallback on the fake
  tensors, so a graph after a break that takes an SDPA output as input may miss too;
- autograd's engine needs the device to run a backward ("hasPrimaryContext expects a valid
  device index"): a backward from a fake tensor gives each leaf it reaches an empty fake
  gradient, laid out as the leaf (what an optimizer step after it reads).
Patched on the classes, not as a TorchFunctionMode: Dynamo traces through function modes,
which changes the graphs it captures (`x + y` became `x.add(y)` under `torch.device(...)`).

Dynamo types each input placeholder after the object it was given (a FakeTensor here, a
Tensor or Parameter in the job), and the payload holds that type: `as_traced_for_real` puts
the job's back.

Uses torch._C._nn._parse_to, FakeTensor, nn.Module._apply's contract, autograd nodes'
`next_functions` and AccumulateGrad's `variable`, torch.cuda.amp.common.
amp_definitely_not_available and torch.cuda.is_bf16_supported (read by torch.autocast),
torch._dynamo.utils.run_node, aten._scaled_dot_product_flash_attention and
_scaled_dot_product_efficient_attention (their fake kernels), and
Dynamo's placeholder `type` and `grapharg` metadata.
Verified: torch 2.13.0 (payload bytes equal to a real trace's, static and dynamic shapes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._dynamo import utils as dynamo_utils
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["as_traced_for_real", "fake_device"]

_SDPA = torch._C._nn.scaled_dot_product_attention
_RANDOM_FILLS = (
    "uniform_",
    "normal_",
    "bernoulli_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
    "random_",
)


@contextlib.contextmanager
def fake_device(cuda_capability: str = "") -> Iterator[None]:
    """Fake tensors move to any device, take random fills in place and run backwards, and
    CUDA's autocast stays on for a target of `cuda_capability` ("9.0"), whatever this torch
    build's runtime can do (see the module's docstring)."""
    tensor = torch.Tensor
    saved = {name: getattr(tensor, name) for name in ("to", "cuda", *_RANDOM_FILLS)}
    original_to, original_cuda = saved["to"], saved["cuda"]

    def to(self, *args, **kwargs):
        if isinstance(self, FakeTensor):
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
            if device is not None and device != self.device and not _has_runtime(device):
                return _moved(self, device, dtype)
        return original_to(self, *args, **kwargs)

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        if isinstance(self, FakeTensor) and not _has_runtime(torch.device("cuda")):
            index = device.index if isinstance(device, torch.device) else device
            return _moved(self, torch.device("cuda", index or 0), None)
        return original_cuda(self, device, non_blocking, memory_format=memory_format)

    def fill(name):
        original = saved[name]

        def random_fill(self, *args, **kwargs):
            if isinstance(self, FakeTensor) and self.device.type != "cpu":
                return self  # a fake tensor's values are never read
            return original(self, *args, **kwargs)

        return random_fill

    original_backward = saved["backward"] = tensor.backward

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        if isinstance(self, FakeTensor) and not _has_runtime(self.device):
            return _fake_backward(self)
        return original_backward(self, gradient, retain_graph, create_graph, inputs)

    patched = {
        "to": to,
        "cuda": cuda,
        "backward": backward,
        **{name: fill(name) for name in _RANDOM_FILLS},
    }
    module_apply = torch.nn.Module._apply
    run_node = dynamo_utils.run_node

    def run_node_with_fused_sdpa(tracer, node, args, kwargs, nnmodule):
        if node.op == "call_function" and node.target is _SDPA:
            fused = _fused_sdpa(cuda_capability, *args, **kwargs)
            if fused is not None:
                return fused
        return run_node(tracer, node, args, kwargs, nnmodule)

    amp = torch.cuda.amp.common
    not_available, bf16 = amp.amp_definitely_not_available, torch.cuda.is_bf16_supported
    try:
        for name, fn in patched.items():
            setattr(tensor, name, fn)
        torch.nn.Module._apply = _apply_overwriting  # type: ignore[method-assign]
        if cuda_capability and not torch.cuda.is_available():
            dynamo_utils.run_node = run_node_with_fused_sdpa
            amp.amp_definitely_not_available = lambda: False
            major = int(cuda_capability.split(".")[0])
            torch.cuda.is_bf16_supported = lambda *args, **kwargs: major >= 8
        yield
    finally:
        for name, fn in saved.items():
            setattr(tensor, name, fn)
        torch.nn.Module._apply = module_apply  # type: ignore[method-assign]
        dynamo_utils.run_node = run_node
        amp.amp_definitely_not_available = not_available
        torch.cuda.is_bf16_supported = bf16


def _fused_sdpa(
    cuda_capability: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    """SDPA's output from the fused kernel a GPU of `cuda_capability` would pick (module
    docstring), or None: the math fallback, as Dynamo runs it."""
    if not isinstance(query, FakeTensor) or _has_runtime(query.device) or enable_gqa:
        return None
    if query.shape[-1] % 8 or value.shape[-1] % 8:
        return None
    half = query.dtype in (torch.float16, torch.bfloat16)
    major = int(cuda_capability.split(".")[0])
    cuda = torch.backends.cuda
    if (
        cuda.flash_sdp_enabled()
        and half
        and major >= 8
        and query.shape[-1] <= 256
        and attn_mask is None
    ):
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, scale=scale
        )[0]
    if cuda.mem_efficient_sdp_enabled():
        grad = any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale
        )[0]
    return None


def _fake_backward(root: torch.Tensor) -> None:
    """Each leaf that `root`'s graph reaches gets an empty gradient (kept if it has one)."""
    seen: set = set()
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad: the leaf it fills
        if leaf is not None and leaf.grad is None:
            leaf.grad = torch.empty_strided(
                leaf.size(), leaf.stride(), dtype=leaf.dtype, device=leaf.device
            )
        stack.extend(next_node for next_node, _ in node.next_functions)


def _apply_overwriting(module: torch.nn.Module, fn, recurse: bool = True) -> torch.nn.Module:
    """`Module._apply` that replaces parameters and buffers by their converted copies."""
    if recurse:
        for child in module.children():
            _apply_overwriting(child, fn)
    for key, param in module._parameters.items():
        if param is not None:
            with torch.no_grad():
                applied = fn(param)
            if applied is not param:
                module._parameters[key] = torch.nn.Parameter(applied, param.requires_grad)
    for key, buffer in module._buffers.items():
        if buffer is not None:
            module._buffers[key] = fn(buffer)
    return module


def as_traced_for_real(gm: torch.fx.GraphModule) -> None:
    """Put back the placeholder types the job's own trace has (a Tensor or a Parameter)."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.type is FakeTensor:
            example = getattr(node.meta.get("grapharg"), "example", None)
            node.type = torch.nn.Parameter if _is_parameter(example) else torch.Tensor
    gm.recompile()


def _is_parameter(t: object) -> bool:
    return isinstance(t, torch.nn.Parameter)


def _has_runtime(device: torch.device) -> bool:
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())


def _moved(t: FakeTensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` on `device` (a fake tensor with its size and strides), a leaf as `.to` makes of a
    leaf; a tensor within autograd's graph cannot be moved without the device."""
    if t.grad_fn is not None:
        raise RuntimeError(
            f"cannot move a tensor inside autograd's graph to {device} without that device"
        )
    moved = torch.empty_strided(t.size(), t.stride(), dtype=dtype or t.dtype, device=device)
    return moved.requires_grad_(t.requires_grad)
