"""Models for the GPU benchmark: GPT-style training step, ResNet-50 inference, SDPA block.

Random weights (no downloads), seeded so that every process builds the same model and input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(
        self, layers: int = 6, d: int = 512, heads: int = 8, vocab: int = 8192, context: int = 512
    ):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build(name: str) -> tuple[nn.Module, list[torch.Tensor], dict]:
    """(model on cuda, example inputs, spec). spec: train, bf16, dynamic_dim, other_sizes."""
    torch.manual_seed(0)
    dev = "cuda"
    if name in ("gpt", "gpt-storm") or name.startswith("gpt-l"):  # (before gpt-small-l<N>)
        d = 384 if name == "gpt-storm" else 512
        # gpt-l<N>: GPT's sibling with N layers instead of 6 (issue 28's sibling misses)
        layers = int(name.removeprefix("gpt-l")) if name.startswith("gpt-l") else 6
        model = GPT(layers=layers, d=d).to(dev)
        x = torch.randint(0, 8192, (16, 256), device=dev)
        return model, [x], {"train": True, "bf16": True}
    if name == "gpt-small" or name.startswith("gpt-small-l"):
        # inference, few GEMM shapes: max-autotune fits in a device call; gpt-small-l<N>: its
        # sibling with N layers (issue 28's max-autotune sibling misses)
        layers = int(name.removeprefix("gpt-small-l")) if name != "gpt-small" else 1
        model = GPT(layers=layers, d=256, heads=4).to(dev).eval()
        x = torch.randint(0, 8192, (8, 128), device=dev)
        return model, [x], {"train": False, "bf16": True}
    if name == "resnet50":
        import torchvision

        model = torchvision.models.resnet50(weights=None).to(dev, memory_format=torch.channels_last)
        model = model.to(torch.bfloat16).eval()
        x = torch.randn(32, 3, 224, 224, device=dev, dtype=torch.bfloat16)
        return (
            model,
            [x.contiguous(memory_format=torch.channels_last)],
            {"train": False, "bf16": False},
        )
    if name == "sdpa-dynamic":
        model = Block(256, 4).to(dev)
        x = torch.randn(8, 128, 256, device=dev)
        others = [torch.randn(8, t, 256, device=dev) for t in (192, 320, 512)]
        return model, [x], {"train": True, "bf16": False, "dynamic_dim": 1, "others": others}
    raise ValueError(f"unknown model {name}")
