"""torch._ops.OpOverload and OpOverloadPacket, the types of `torch.ops.*` operators: torch
names them only in a private module, so they are reached only through here."""

from __future__ import annotations

import torch


def is_operator(target: object) -> bool:
    """True for a torch operator, overload (`torch.ops.aten.add.Tensor`) or packet
    (`torch.ops.aten.add`)."""
    return isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
