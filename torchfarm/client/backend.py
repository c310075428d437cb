"""The Dynamo backend `torchfarm`: every graph Dynamo captures goes through the farm.

Registered through the `torch_dynamo_backends` entry point, so `torch.compile(m,
backend="torchfarm")` needs no import. A farm that is unset, down, slow or failing never
breaks the job: the graph is compiled locally (then run eagerly), with one warning. Where the
local compile fails with one of the fake-tensor errors on which Dynamo splits a graph (an op
whose output depends on data), the error goes to Dynamo, which then splits the graph around
that op exactly as it does for local torch.compile.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
import uuid
import warnings
from collections.abc import Callable

import torch

from torchfarm import signing, torch_adapter
from torchfarm.client import remote
from torchfarm.client.progress import ProgressLine
from torchfarm.compiler import guards, serialize, trace_state
from torchfarm.compiler.inductor import config_patches, load_artifact
from torchfarm.compiler.target import local_target
from torchfarm.contract.cache_key import public_key
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings
from torchfarm.torch_adapter.local_compile import compile_locally, exceptions_allowed_to_be_fallback

log = logging.getLogger("torchfarm")
_graph_numbers = itertools.count(1)
_warned: set[str] = set()


@dataclasses.dataclass(frozen=True)
class GraphRecord:
    """What happened to one graph: source is hit, miss, merged, local, eager, or split (handed
    back to Dynamo to split, whose smaller graphs get records of their own)."""

    label: str
    source: str
    seconds: float
    bytes: int = 0
    key: str = ""
    why: str = ""  # for local and eager: why the farm (and local compile) did not serve it


# Every graph this process compiled, in order; for logs, the demo and tests.
history: list[GraphRecord] = []


def torchfarm_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    mode: str | None = None,
    options: dict | None = None,
    *,
    addr: str | None = None,
    token: str | None = None,
) -> Callable:
    """Compile one Dynamo graph on the farm; `options` are Inductor config patches."""
    settings = ClientSettings.from_env(addr=addr, token=token)
    farm_options = pb.Options(
        mode=mode or "default",
        config_patches_json=json.dumps(options, sort_keys=True) if options else "",
        state=trace_state.capture(),
    )
    label = f"graph {next(_graph_numbers)}"
    started = time.perf_counter()
    if not settings.addr:
        _warn_once("TORCHFARM_ADDR is not set: compiling locally")
        return _compile_locally(gm, example_inputs, farm_options, label, started)
    if torch_adapter.UNVERIFIED:  # never drift silently: the farm's torch code may not fit
        _warn_once(f"{torch_adapter.UNVERIFIED}; compiling locally")
        return _compile_locally(
            gm, example_inputs, farm_options, label, started, why=torch_adapter.UNVERIFIED
        )
    try:
        compiled, header = _compile_on_farm(gm, settings, farm_options, label)
    except remote.UntrustedEntry as e:  # a miss: those bytes are never loaded
        _warn_once(f"{e}; compiling locally")
        return _compile_locally(
            gm, example_inputs, farm_options, label, started, why=f"untrusted: {e}"
        )
    except Exception as e:  # the farm must never break training
        log.info("%s: farm failed after %.2f s (%s)", label, time.perf_counter() - started, e)
        _warn_once(f"farm unavailable ({e}); compiling locally")
        return _compile_locally(
            gm, example_inputs, farm_options, label, started, why=f"farm: {type(e).__name__}: {e}"
        )
    record = GraphRecord(
        label, header.source, time.perf_counter() - started, header.size, header.key
    )
    history.append(record)
    log.info(
        "%s: farm %s in %.2f s, %d bytes, key %s",
        label,
        record.source,
        record.seconds,
        record.bytes,
        header.key[:16],
    )
    return compiled


def _device_of(gm: torch.fx.GraphModule) -> str:
    """cuda if any input or intermediate value of the graph lives there (a graph may take CPU
    inputs and move them to the GPU), else cpu."""
    values = [n.meta.get("example_value") for n in gm.graph.nodes]
    for value in [*serialize.example_inputs(gm), *values]:
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            return str(value.device)
    return "cpu"


def _compile_on_farm(gm, settings, options, label) -> tuple[Callable, pb.ArtifactHeader]:
    request = pb.CompileRequest(
        graph=serialize.dumps(gm),
        target=local_target(_device_of(gm)),
        options=options,
        label=label,
        private=settings.private,
        size_hints=serialize.size_hints(gm),
    )
    inputs = serialize.example_inputs(gm)
    request_id = uuid.uuid4().hex[:16]
    log.debug("%s: request %s", label, request_id)
    # Signing: nothing from the farm is evaluated or loaded unless a trusted key signed it.
    trusted = remote.verifier(settings, request_id)
    graph_key = public_key(request.graph, request.target, request.options)
    signed: list[pb.Candidate] = []
    unsigned: list[pb.Candidate] = []
    for c in remote.lookup(graph_key, settings, request.private, request_id):
        (signed if signing.entry_verifies(trusted, graph_key, c) else unsigned).append(c)
    # Entries of this key differ by their guards: take one that holds here, else compile.
    request.digest = next((c.digest for c in signed if guards.hold(c.guards, inputs)), "")
    if not request.digest and any(not c.guards.all for c in unsigned):
        # the farm serves an unguarded entry to a request that names none: this one again
        raise remote.UntrustedEntry(f"an entry of key {graph_key[:16]} is not signed by the farm")
    progress = ProgressLine(label, settings.progress)
    try:
        header, data = remote.fetch(request, settings, on_progress=progress, request_id=request_id)
    finally:
        progress.close()
    artifact = pb.Artifact.FromString(data)  # protobuf only: nothing runs before the check
    served = pb.Candidate(
        digest=header.digest,
        size=header.size,
        guards=artifact.guards,
        signature=header.signature,
    )
    if not signing.entry_verifies(trusted, graph_key, served):
        raise remote.UntrustedEntry(
            f"the artifact of key {graph_key[:16]} is not signed by the farm"
        )
    if not guards.install(artifact.guards, inputs):
        raise remote.FarmError("the artifact's shape guards do not hold for these inputs")
    compiled = load_artifact(
        artifact,
        cudagraphs=bool(config_patches(options).get("triton.cudagraphs")),
        device_index=serialize.local_device_index(gm),
    )
    return (lambda *args: compiled(*args)), header


def _compile_locally(
    gm, example_inputs, options: pb.Options, label: str, started: float, why: str = ""
) -> Callable:
    try:
        compiled = compile_locally(gm, example_inputs, config_patches(options))
        source = "local"
    except exceptions_allowed_to_be_fallback as e:  # Dynamo splits the graph, as for Inductor
        history.append(
            GraphRecord(
                label,
                "split",
                time.perf_counter() - started,
                why=f"{why}; local: {type(e).__name__}: {e}"[-2000:],
            )
        )
        log.info("%s: handed back to Dynamo to split (%s: %s)", label, type(e).__name__, e)
        raise
    except Exception as e:
        _warn_once(f"local compile failed too ({type(e).__name__}: {e}); running eagerly")
        compiled, source = gm.forward, "eager"
        why = f"{why}; local: {type(e).__name__}: {e}"
    history.append(GraphRecord(label, source, time.perf_counter() - started, why=why[-2000:]))
    log.info("%s: %s compile in %.2f s", label, source, time.perf_counter() - started)
    return compiled


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"torchfarm: {message}", RuntimeWarning, stacklevel=3)
