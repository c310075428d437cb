"""torchfarm: a remote compilation farm for torch.compile.

`torch.compile(model, backend="torchfarm")` or `@torchfarm.compile(...)` sends Dynamo's graphs
to a farm that compiles them once, for every process, rank and user.

Importing torchfarm does not import torch: the gateway and the CLI never need it, so the
decorator (which does) loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchfarm.client.decorator import compile

__all__ = ["compile"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "compile":
        from torchfarm.client.decorator import compile  # noqa: PLC0415  (loads torch)

        return compile
    raise AttributeError(f"module 'torchfarm' has no attribute {name!r}")
