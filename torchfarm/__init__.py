"""torchfarm: a remote compilation farm for torch.compile.

`torch.compile(model, backend="torchfarm")` or `@torchfarm.compile(...)` sends Dynamo's graphs
to a farm that compiles them once, for every process, rank and user.
"""

from torchfarm.client.decorator import compile

__all__ = ["compile"]
__version__ = "0.1.0"
