"""What Dynamo resolves for `torch.compile(m, backend="torchfarm")` (the
`torch_dynamo_backends` entry point, pyproject.toml).

Resolving the backend starts the process's one-time work (backend.start: the load path's
imports, the prewarm thread, the farm's connection), so that it overlaps Dynamo's first trace,
as `backend="inductor"` imports its compile path inside torch.compile; started at the first
graph instead, a GPU hit waited for it after the trace. Importing this module, or the
backend, starts nothing: only the entry point's lookup of the attribute does (PEP 562).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name != "torchfarm_backend":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from torchfarm.client import collector

    with collector.paused():  # the client's imports
        from torchfarm.client import backend, decorator
        from torchfarm.settings import ClientSettings

        settings = ClientSettings.from_env()
        backend.start(settings)
        if decorator.skips_tracing(settings):
            from torchfarm.torch_adapter.trace import named_backend

            named_backend.intercept(backend.torchfarm_backend, decorator.take_over)
    return backend.torchfarm_backend
