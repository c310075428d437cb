"""A small encoder whose modules call TorchScript functions (as older transformers encoders
did): Dynamo guards the ScriptFunction globals' types, which the skip saves by name (issue 49;
torch_adapter/trace/script_functions.py)."""

import torch
from torch import nn


@torch.jit.script
def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    y = x + bias
    return y * 0.5 * (1.0 + torch.erf(y / 1.41421))


@torch.jit.script
def scaled_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1)


class Layer(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.bias, self.down = (
            nn.Linear(d, 4 * d, bias=False),
            nn.Parameter(torch.zeros(4 * d)),
            nn.Linear(4 * d, d),
        )
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = scaled_scores(q, k, float(q.shape[-1]) ** -0.5) @ v
        x = x + self.out(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(bias_gelu(self.up(self.norm2(x)), self.bias))


class Encoder(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
