"""`@torchfarm.compile(...)`: torch.compile through the farm, on a function, a module or a
module class."""

from __future__ import annotations

import functools

import torch


def compile(
    obj=None,
    *,
    mode: str = "default",
    dynamic: bool | None = None,
    fullgraph: bool = False,
    options: dict | None = None,
    addr: str | None = None,
    token: str | None = None,
    wait: bool | None = None,
):
    """Compile `obj` through the farm. Usable bare (`@torchfarm.compile`) or with arguments.
    `wait=False` runs a graph the farm must compile eagerly meanwhile (default: TORCHFARM_WAIT)."""
    from torchfarm.client.backend import torchfarm_backend

    backend = functools.partial(
        torchfarm_backend, mode=mode, options=options, addr=addr, token=token, wait=wait
    )
    kwargs = dict(backend=backend, dynamic=dynamic, fullgraph=fullgraph)

    def wrap(target):
        if isinstance(target, type) and issubclass(target, torch.nn.Module):
            init = target.__init__

            @functools.wraps(init)
            def __init__(self, *args, **kw):
                init(self, *args, **kw)
                self.compile(**kwargs)

            target.__init__ = __init__
            return target
        return torch.compile(target, **kwargs)

    return wrap if obj is None else wrap(obj)
