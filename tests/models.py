"""Small models the tests compile: an MLP, a CNN and a transformer block using SDPA."""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, out: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, out))

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


class TransformerBlock(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class BlockMLP(nn.Module):
    """Blocks of one layer each, each of its own width (so each is a graph of its own): under
    DDP with buckets no larger than a block (each block's weights are over 1 MiB),
    DDPOptimizer splits the graph at every block."""

    def __init__(self, blocks: int = 6, dim: int = 512):
        super().__init__()
        widths = [dim + 32 * i for i in range(blocks + 1)]
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in zip(widths, widths[1:]))
        )
        self.head = nn.Linear(widths[-1], 10)

    def forward(self, x):
        return self.head(self.blocks(x))


MODELS = {
    "mlp": (MLP, lambda: torch.randn(8, 32)),
    "cnn": (SmallCNN, lambda: torch.randn(4, 3, 16, 16)),
    "transformer": (TransformerBlock, lambda: torch.randn(2, 16, 64)),
    # compiled only by fresh-process tests, so that their first run is a farm miss
    "transformer96": (lambda: TransformerBlock(dim=96), lambda: torch.randn(2, 16, 96)),
    "mlp12": (lambda: MLP(out=12), lambda: torch.randn(8, 32)),
    "blocks": (BlockMLP, lambda: torch.randn(16, 512)),
}


def build(name: str, seed: int = 0):
    cls, make_input = MODELS[name]
    torch.manual_seed(seed)
    return cls(), make_input()
