"""`torch.compile(m, backend="torchfarm")` handed to the skip (issue 49 item 4): the one moment
a backend named by string can act before Dynamo traces a frame.

Nothing else reaches it in time, on 2.11, 2.13 or 2.15: torch.compile resolves the name once
per process (`backends.registry.lookup_backend` caches the entry point's object) and wraps it
in `torch._TorchCompileWrapper`, which shows `_optimize` neither `backend_ctx_ctor` nor
`get_compiler_config` (2.15's `_dynamo_backend_init` gets through, with no argument); Dynamo
records a package only where `torch._dynamo.optimize(package=...)` is given one, which
torch.compile never does, or where the process-wide `caching_precompile` flag is set; and
the backend is first called after its frame was traced. What remains is the method that
makes the compiled callable, `OptimizeContext.__call__(fn)`, called inside torch.compile:
there `intercept`'s wrapper offers `fn` and the compile's arguments to the backend's
`take_over`, whose result torch.compile then returns (the decorator hands Dynamo its package
at the same moment). Any other context goes to torch's own method unchanged: frames compiled
with other backends see nothing of this.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo import eval_frame

log = logging.getLogger("torchfarm")


@dataclasses.dataclass(frozen=True)
class Compile:
    """The arguments of one `torch.compile(fn, backend=...)` that the backend sees."""

    mode: str | None
    options: dict | None
    dynamic: bool | None
    fullgraph: bool


TakeOver = Callable[[Any, Compile], Any]
_take_overs: dict[Callable, TakeOver] = {}  # by the backend object the name resolves to
_wrapped = False


def intercept(backend: Callable, take_over: TakeOver) -> None:
    """From now on `torch.compile(fn, backend=<backend or its name>)` returns `take_over(fn,
    compile)` where that is not None. Only a compile made as plain torch.compile makes it is
    offered (no guard hooks, recompile limit, isolated recompiles or shapes spec: arguments
    take_over could not pass on; not a function of torch's own). An exception from take_over is
    logged in one line and torch.compile goes on as without it."""
    global _wrapped
    if not _wrapped:
        _wrapped = True
        original = eval_frame.OptimizeContext.__call__

        def __call__(ctx: Any, fn: Any) -> Any:
            found = _offered(ctx, fn)
            if found is not None:
                take, compile = found
                try:
                    compiled = take(fn, compile)
                except Exception as e:
                    name = getattr(fn, "__qualname__", type(fn).__name__)
                    log.info(
                        "torch.compile(%s) traces as always (%s: %s)", name, type(e).__name__, e
                    )
                else:
                    if compiled is not None:
                        return compiled
            return original(ctx, fn)

        eval_frame.OptimizeContext.__call__ = __call__  # type: ignore[method-assign,assignment]
    _take_overs[backend] = take_over


def _offered(ctx: Any, fn: Any) -> tuple[TakeOver, Compile] | None:
    """The take_over and arguments for this context, or None: another backend, an argument
    take_over cannot pass on, a context of a shape this torch did not make before, or a
    function of torch's own (below)."""
    try:
        if _torchs_own(fn):
            return None
        inner = eval_frame.innermost_backend(ctx.callback)
        kwargs: dict[str, Any] = {}
        if isinstance(inner, torch._TorchCompileWrapper):  # torch.compile's, not optimize's
            kwargs, inner = inner.kwargs, inner.compiler_fn
        take = _take_overs.get(inner)
        if take is None or set(kwargs) - {"mode", "options"}:
            return None
        hooks = ctx._hooks
        convert = ctx.callback._torchdynamo_orig_backend  # ConvertFrame(Assert)
        extras = (
            hooks.guard_export_fn,
            hooks.guard_fail_fn,
            hooks.guard_filter_fn,
            ctx._package,
            getattr(convert, "_recompile_limit", None),  # 2.13+
            getattr(ctx, "_shapes_spec", None),  # 2.13
            getattr(ctx, "_dynamic_shapes", None),  # 2.15
        )
        if any(x is not None for x in extras) or ctx.export:
            return None
        if getattr(ctx, "_isolate_recompiles_id", -1) != -1:  # 2.13+
            return None
        compile = Compile(kwargs.get("mode"), kwargs.get("options"), ctx._dynamic, ctx.fullgraph)
        return take, compile
    except Exception:  # a context this torch builds differently: torch's own path
        return None


def _torchs_own(fn: Any) -> bool:
    """A function of torch's code, not the model's: `module.compile()` compiles
    `Module._call_impl` (traced as always, as a module class), and torch's compile of a module
    instance that take_over declined compiles the module's call through this method again
    (`OptimizedModule._initialize`). A package would be keyed by torch's code."""
    if isinstance(fn, torch.nn.Module):
        return False
    module = getattr(getattr(fn, "__func__", fn), "__module__", None) or ""
    return module == "torch" or module.startswith("torch.")
