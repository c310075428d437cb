"""The client's local compile, used whenever the farm cannot serve a graph.

Uses torch._inductor.compile_fx.compile_fx (what backend="inductor" runs) and
torch._dynamo.exc.exceptions_allowed_to_be_fallback (the errors on which Dynamo splits a
graph). Verified: torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch._dynamo.exc import exceptions_allowed_to_be_fallback

__all__ = ["compile_locally", "exceptions_allowed_to_be_fallback"]


def compile_locally(
    gm: torch.fx.GraphModule, example_inputs: list, config_patches: dict
) -> Callable:
    """Inductor in this process, as torch.compile's default backend does it."""
    from torch._inductor.compile_fx import compile_fx

    return cast(Callable, compile_fx(gm, example_inputs, config_patches=config_patches))
