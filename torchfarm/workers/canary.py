"""The canary: a worker proves it can compile before it takes a job.

At start-up the worker traces a two-op function of its own (trusted: nothing of a client's),
serializes the graph as a client does, for the worker's own target, and compiles it through
exactly the path of real jobs (sandbox.run_compile: the sandbox, the child, the operator's
TORCHFARM_OP_LIBRARIES). Everything that breaks every compile (a package shadowed by the
working directory, a sandbox bind that hides the interpreter, an op library that does not
import, a broken toolchain) then shows before the worker is called ready, with the child's
own error, instead of as one failed job after another while the farm looks healthy.

A worker whose canary fails registers the error (cache/pools.py keeps it FAILURE_TTL_S) and
exits non-zero; it does not retry on its own. What breaks the canary (the image, the sandbox,
an op library, the toolchain) breaks it again until an operator acts, and a worker that stays
up looks healthy to everything that watches processes: an exited one shows in `docker compose
ps` with its error in its log (the restart policy is the backoff), ends `torchfarm up` with
that error, and the gateway and `torchfarm doctor` read the error from the registry.
"""

from __future__ import annotations

import logging
import time

import torch

from torchfarm.cache.pools import Readiness
from torchfarm.compiler import serialize
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import WorkerSettings
from torchfarm.torch_adapter.trace.fake_tensors import FakeTensorMode
from torchfarm.workers import sandbox

log = logging.getLogger("torchfarm.worker")
ERROR_CHARS = 2000  # of the child's error kept in the registry (its traceback's tail)


def _tiny(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) * 2 + 1


def canary_request(device: str) -> tuple[bytes, dict[str, int]]:
    """The canary's payload and size hints: `_tiny` traced by Dynamo for `device`, as a
    client's backend would hand it to the farm. The input is a FakeTensor: the worker's own
    process never touches the device (no CUDA context held for the worker's lifetime)."""
    captured: dict[str, bytes | dict[str, int]] = {}

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        captured["graph"], captured["hints"] = serialize.dumps(gm), serialize.size_hints(gm)
        return gm.forward

    with FakeTensorMode():
        x = torch.empty(4, 8, device=device)
    torch.compile(_tiny, backend=capture, dynamic=False, fullgraph=True)(x)
    graph, hints = captured["graph"], captured["hints"]
    assert isinstance(graph, bytes) and isinstance(hints, dict)
    return graph, hints


def run(settings: WorkerSettings, target: pb.Target) -> Readiness:
    """Compile the canary for `target` in the sandbox; ready, or failed with the error."""
    started = time.perf_counter()
    try:
        graph, hints = canary_request(settings.device)
        # The first child warms up inside the canary's compile: on a busy host that alone
        # can outlast a short compile timeout, which is no sign of a broken one.
        timeout_s = max(settings.compile_timeout_s, settings.warm_up_timeout_s)
        spec = sandbox.ChildSpec(graph, target, pb.Options(), hints, timeout_s=timeout_s)
        data = sandbox.run_compile(spec, settings).data
        artifact = pb.Artifact.FromString(data)  # protobuf parse: no code runs
        if not artifact.inductor:
            raise ValueError("the compile child returned an empty artifact")
    except Exception as e:  # whatever stops the canary stops every job the same way
        error = f"{type(e).__name__}: {e}".strip()[-ERROR_CHARS:]
        log.error("canary compile failed: %s", error)
        return Readiness("failed", error, time.time())
    log.info("canary compile ok in %.1f s", time.perf_counter() - started)
    return Readiness("ready", "", time.time())
