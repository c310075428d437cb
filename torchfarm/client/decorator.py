"""`@torchfarm.compile(...)`: torch.compile through the farm, on a function, a module or a
module class.

With a token, on a torch that torch_adapter/trace/dynamo_package.py verified, and with
TORCHFARM_SKIP_TRACING=1 (unset: on only where the release is in dynamo_package.DEFAULT_ON),
a function or module instance also gets a Dynamo package
(client/packages.py): a later process skips Dynamo's tracing where the farm holds one. So does
`torch.compile(fn_or_module, backend="torchfarm")` (`take_over`, offered the compile by
torch_adapter/trace/named_backend.py). A module class traces as always (Dynamo's package must
be handed to Dynamo when the compiled function is made; see docs/architecture.md, "Skipping
Dynamo on a hit").
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from torchfarm.client import collector, keywords
from torchfarm.settings import ClientSettings

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's; the package supports 3.10
    from typing_extensions import Unpack

    from torchfarm.torch_adapter.trace.named_backend import Compile

log = logging.getLogger("torchfarm")


class CompileOptions(TypedDict, total=False):
    """torch.compile's keywords that torchfarm.compile takes as torch.compile does (defaults:
    DEFAULTS); `options` are Inductor config patches."""

    mode: str
    dynamic: bool | None
    fullgraph: bool
    options: dict | None


DEFAULTS: CompileOptions = {"mode": "default", "dynamic": None, "fullgraph": False, "options": None}


def compile(
    obj=None,
    *,
    addr: str | None = None,
    token: str | None = None,
    wait: bool | None = None,
    **options: Unpack[CompileOptions],
):
    """Compile `obj` through the farm. Usable bare (`@torchfarm.compile`) or with arguments:
    torch.compile's `mode`, `dynamic`, `fullgraph` and `options` (CompileOptions), and the
    farm's `addr` and `token` (default: TORCHFARM_ADDR, TORCHFARM_TOKEN) and `wait`:
    `wait=False` runs a graph the farm must compile eagerly meanwhile (default: TORCHFARM_WAIT)."""
    chosen = keywords.chosen(compile, options, DEFAULTS)
    with collector.paused():  # the client's imports
        from torchfarm.client.backend import start, torchfarm_backend

        start(ClientSettings.from_env(addr=addr, token=token, wait=wait))  # overlaps the trace
    backend = functools.partial(
        torchfarm_backend,
        mode=chosen["mode"],
        options=chosen["options"],
        addr=addr,
        token=token,
        wait=wait,
    )
    kwargs = dict(backend=backend, dynamic=chosen["dynamic"], fullgraph=chosen["fullgraph"])

    @collector.paused()  # a package's restore imports and unpickles
    def wrap(target):
        if isinstance(target, type) and issubclass(target, torch.nn.Module):
            init = target.__init__

            @functools.wraps(init)
            def __init__(self, *args, **kw):
                init(self, *args, **kw)
                self.compile(**kwargs)

            target.__init__ = __init__
            return target
        settings = ClientSettings.from_env(addr=addr, token=token)
        if skips_tracing(settings):
            try:
                return _with_package(target, backend, settings, chosen)
            except Exception as e:  # e.g. no source to key the package by: trace as always
                name = getattr(target, "__qualname__", type(target).__name__)
                log.info("no Dynamo package for %s (%s: %s)", name, type(e).__name__, e)
        return torch.compile(target, **kwargs)

    return wrap if obj is None else wrap(obj)


@collector.paused()  # a package's restore imports and unpickles
def take_over(target: Any, compile: Compile) -> Any:
    """`torch.compile(target, backend="torchfarm")` with the skip, as `torchfarm.compile(target)`
    with the same arguments makes it, under a package key of its own (the entry point is in
    it: a process that compiles one model both ways traces and saves each); None where the
    skip does not apply (then torch.compile traces as always)."""
    from torchfarm.client.backend import torchfarm_backend

    if isinstance(target, type):  # a module class: traced as always, as by the decorator
        return None
    settings = ClientSettings.from_env()
    if not skips_tracing(settings):
        return None
    backend = functools.partial(torchfarm_backend, mode=compile.mode, options=compile.options)
    chosen: CompileOptions = {
        "mode": compile.mode or DEFAULTS["mode"],
        "dynamic": compile.dynamic,
        "fullgraph": compile.fullgraph,
        "options": compile.options,
    }
    return _with_package(target, backend, settings, chosen, entry="torch.compile")


def skips_tracing(settings: ClientSettings) -> bool:
    from torchfarm import torch_adapter
    from torchfarm.torch_adapter.trace import dynamo_package

    wanted = settings.skip_tracing
    if wanted is None:
        wanted = dynamo_package.on_by_default()
    return bool(
        wanted
        and settings.addr
        and settings.token
        and not torch_adapter.UNVERIFIED
        and dynamo_package.supported()
    )


def _with_package(
    target, backend, settings: ClientSettings, chosen: CompileOptions, entry: str = ""
):
    """Dynamo's wrapper around `target` with the package restored (or recording); the package
    is saved after the first call returns. `entry`: the entry point other than
    torchfarm.compile, in the package key."""
    from torchfarm.client.packages import Skipper
    from torchfarm.torch_adapter.trace import dynamo_package

    dynamic, fullgraph = chosen["dynamic"], chosen["fullgraph"]
    keyed = dict(
        mode=chosen["mode"], dynamic=dynamic, fullgraph=fullgraph, **(chosen["options"] or {})
    )
    if entry:
        keyed["entry"] = entry
    skipper = Skipper(target, settings, keyed)
    compiled = dynamo_package.optimize(backend, skipper.package, dynamic, fullgraph)(target)
    if isinstance(compiled, torch.nn.Module):
        compiled.register_forward_hook(lambda *_: skipper.after_first_call())
        return compiled

    @functools.wraps(target)
    def call(*args, **kw):
        result = compiled(*args, **kw)
        skipper.after_first_call()
        return result

    return call
