"""torchfarm: a remote compilation farm for torch.compile.

`torch.compile(model, backend="torchfarm")` or `@torchfarm.compile(...)` sends Dynamo's graphs
to a farm that compiles them once, for every process, rank and user.
`torchfarm.aoti_compile_and_package(exported_program)` does the same for a torch.export
program with AOTInductor, and `torchfarm.aoti_load_package` loads what it returns.

Importing torchfarm does not import torch: the gateway and the CLI never need it, so the
decorator (which does) loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchfarm.client.decorator import compile
    from torchfarm.client.exported import aoti_compile_and_package, aoti_load_package

__all__ = ["aoti_compile_and_package", "aoti_load_package", "compile"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "compile":
        from torchfarm.client.decorator import compile  # noqa: PLC0415  (loads torch)

        return compile
    if name in ("aoti_compile_and_package", "aoti_load_package"):
        from torchfarm.client import exported  # noqa: PLC0415  (loads torch)

        return getattr(exported, name)
    raise AttributeError(f"module 'torchfarm' has no attribute {name!r}")
