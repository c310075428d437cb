"""Small models the tests compile: an MLP, a CNN, a transformer block using SDPA and a stack
of them; and a block exported with torch.export (a dynamic batch) for AOTInductor."""

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


class ExportBlock(nn.Module):
    """What an AOTInductor package must carry: parameters, a buffer, one small enough that
    Inductor would write its values into the code, under a dynamic batch."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 8)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(self.norm(x)))) * self.scale


def exported_block(
    seed: int, max_batch: int = 512
) -> tuple[nn.Module, torch.export.ExportedProgram]:
    """ExportBlock with weights of `seed`, exported with a dynamic batch (2..max_batch: a
    program of its own for each)."""
    torch.manual_seed(seed)
    model = ExportBlock().eval()
    for p in model.parameters():  # LayerNorm's ones and zeros would hide a placeholder
        nn.init.normal_(p)
    batch = torch.export.Dim("batch", min=2, max=max_batch)
    program = torch.export.export(model, (torch.randn(4, 32),), dynamic_shapes={"x": {0: batch}})
    return model, program


def relative_diff(compiled, model: nn.Module) -> float:
    """The largest difference of `compiled` from `model` at the example's batch and two
    others of the exported range, relative to the model's largest value."""
    worst = 0.0
    with torch.no_grad():
        for batch in (4, 3, 97):
            x = torch.randn(batch, 32)
            eager = model(x)
            worst = max(worst, ((compiled(x) - eager).abs().max() / eager.abs().max()).item())
    return worst
