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
import functools
import itertools
import json
import logging
import threading
import time
import uuid
import warnings
from collections.abc import Callable

import torch

from torchfarm import signing, torch_adapter
from torchfarm.client import remote
from torchfarm.client.pool import Job, pool
from torchfarm.client.progress import ProgressLine
from torchfarm.compiler import guards, serialize, trace_state
from torchfarm.compiler.inductor import config_patches, load_artifact
from torchfarm.compiler.target import local_target
from torchfarm.contract.cache_key import public_key
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings
from torchfarm.torch_adapter.deferrable import deferrable
from torchfarm.torch_adapter.local_compile import compile_locally, exceptions_allowed_to_be_fallback

log = logging.getLogger("torchfarm")
_graph_numbers = itertools.count(1)
_warned: set[str] = set()


@dataclasses.dataclass(frozen=True)
class GraphRecord:
    """What happened to one graph: source is hit, miss, merged, local, eager, or split (handed
    back to Dynamo to split, whose smaller graphs get records of their own).

    `submitted` and `awaited` (time.monotonic()) are when the backend got the graph and when
    its compiled code was first needed: at once for a blocking graph, at its first call for a
    deferred one (fetched in the background while Dynamo went on, see client/pool.py).
    `seconds` runs from submission until the code was ready to run."""

    label: str
    source: str
    seconds: float
    bytes: int = 0
    key: str = ""
    digest: str = ""  # farm graphs: the artifact served
    why: str = ""  # for local and eager: why the farm (and local compile) did not serve it
    submitted: float = 0.0
    awaited: float = 0.0
    deferred: bool = False
    # farm graphs: where the time went, seconds: the worker's MissTimings on a miss (queued_s,
    # handoff_s, child_s, compile_s, store_s), then transfer_s and load_s here
    timings: dict[str, float] = dataclasses.field(default_factory=dict)


# Every graph this process compiled, in the order their code became ready; for logs, the demo
# and tests.
history: list[GraphRecord] = []
# Called with each graph and its farm request: client/packages.py keeps them for the package
# that skips Dynamo's tracing in a later process.
request_observers: list[Callable[[torch.fx.GraphModule, pb.CompileRequest], None]] = []


def torchfarm_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    mode: str | None = None,
    options: dict | None = None,
    *,
    addr: str | None = None,
    token: str | None = None,
) -> Callable:
    """Compile one Dynamo graph on the farm; `options` are Inductor config patches.

    A static graph of torch's own operators (torch_adapter/deferrable.py: nothing to install
    into Dynamo's ShapeEnv, no split to hand to Dynamo) is fetched in the background and the
    call returns at once, so that the graphs Dynamo hands over before running any
    (DDPOptimizer's buckets) compile in parallel; its first call waits for it. Any other
    graph blocks here, as before."""
    settings = ClientSettings.from_env(addr=addr, token=token)
    farm_options = pb.Options(
        mode=mode or "default",
        config_patches_json=json.dumps(options, sort_keys=True) if options else "",
        state=trace_state.capture(),
    )
    label = f"graph {next(_graph_numbers)}"
    started = time.monotonic()
    if not settings.addr:
        _warn_once("TORCHFARM_ADDR is not set: compiling locally")
        return _compile_locally(gm, example_inputs, farm_options, label, started)
    if torch_adapter.UNVERIFIED:  # never drift silently: the farm's torch code may not fit
        _warn_once(f"{torch_adapter.UNVERIFIED}; compiling locally")
        return _compile_locally(
            gm, example_inputs, farm_options, label, started, why=torch_adapter.UNVERIFIED
        )
    inputs = serialize.example_inputs(gm)
    try:
        request = _request(gm, settings, farm_options, label)
        for observe in request_observers:
            observe(gm, request)
        if settings.parallel_graphs and deferrable(gm):
            remote.channel(settings.addr, settings.tls_ca)  # made here once, shared by all
            job = pool(settings.parallel_graphs).submit(
                functools.partial(_fetch, request, settings, inputs)
            )
            log.debug("%s: submitted", label)
            return DeferredGraph(gm, job, farm_options, label, started)
        artifact, header, timings = _fetch(request, settings, inputs)
        if not guards.install(artifact.guards, inputs):
            raise remote.FarmError("the artifact's shape guards do not hold for these inputs")
        compiled = _load(artifact, farm_options, serialize.local_device_index(gm), timings)
    except Exception as e:  # the farm must never break training
        why = _farm_failed(e, label, started)
        return _compile_locally(gm, example_inputs, farm_options, label, started, why=why)
    _record_farm(label, header, started, started, timings)
    return compiled


class DeferredGraph:
    """The code of a graph fetched in the background. The first call waits for the fetch,
    checks that the artifact's shape guards hold for the real inputs, and loads it on the
    calling thread (as the blocking path does; loading is not proven thread-safe); a farm
    failure compiles the graph locally right then (or runs it eagerly), with the one warning."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        job: Job[tuple[pb.Artifact, pb.ArtifactHeader, dict[str, float]]],
        options: pb.Options,
        label: str,
        submitted: float,
    ):
        self._gm: torch.fx.GraphModule | None = gm
        self._device_index = serialize.local_device_index(gm)
        self._job = job
        self._options, self._label, self._submitted = options, label, submitted
        self._compiled: Callable | None = None
        self._lock = threading.Lock()

    def __call__(self, *args):
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    self._compiled = self._resolve(list(args))
        return self._compiled(*args)

    def _resolve(self, args: list) -> Callable:
        awaited = time.monotonic()
        gm, self._gm = self._gm, None  # nothing of the graph is kept once its code is ready
        assert gm is not None
        try:
            artifact, header, timings = self._job.result()
            if not guards.hold(artifact.guards, args):
                raise remote.FarmError("the artifact's shape guards do not hold for these inputs")
            compiled = _load(artifact, self._options, self._device_index, timings)
        except Exception as e:  # the farm must never break training
            why = _farm_failed(e, self._label, self._submitted)
            return _compile_locally(
                gm, args, self._options, self._label, self._submitted, why=why, awaited=awaited
            )
        _record_farm(self._label, header, self._submitted, awaited, timings, deferred=True)
        return compiled


def _record_farm(
    label: str,
    header: pb.ArtifactHeader,
    submitted: float,
    awaited: float,
    timings: dict[str, float],
    deferred=False,
) -> None:
    record = GraphRecord(
        label,
        header.source,
        time.monotonic() - submitted,
        header.size,
        header.key,
        header.digest,
        submitted=submitted,
        awaited=awaited,
        deferred=deferred,
        timings=timings,
    )
    history.append(record)
    log.info(
        "%s: farm %s in %.2f s (waited %.2f s), %d bytes, key %s",
        label,
        record.source,
        record.seconds,
        time.monotonic() - awaited,
        record.bytes,
        header.key[:16],
    )


def _farm_failed(e: Exception, label: str, started: float) -> str:
    """Warns (once) that a graph compiles locally because of `e`; returns why, for the record."""
    if isinstance(e, remote.UntrustedEntry):  # a miss: those bytes are never loaded
        _warn_once(f"{e}; compiling locally")
        return f"untrusted: {e}"
    log.info("%s: farm failed after %.2f s (%s)", label, time.monotonic() - started, e)
    _warn_once(f"farm unavailable ({e}); compiling locally")
    return f"farm: {type(e).__name__}: {e}"


def _device_of(gm: torch.fx.GraphModule) -> str:
    """cuda if any input or intermediate value of the graph lives there (a graph may take CPU
    inputs and move them to the GPU), else cpu."""
    values = [n.meta.get("example_value") for n in gm.graph.nodes]
    for value in [*serialize.example_inputs(gm), *values]:
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            return str(value.device)
    return "cpu"


def _request(gm, settings, options, label) -> pb.CompileRequest:
    """The graph's Compile request, built on Dynamo's thread (pickling reads its ShapeEnv)."""
    return pb.CompileRequest(
        graph=serialize.dumps(gm),
        target=local_target(_device_of(gm)),
        options=options,
        label=label,
        private=settings.private,
        size_hints=serialize.size_hints(gm),
    )


def _fetch(
    request: pb.CompileRequest, settings: ClientSettings, inputs: list
) -> tuple[pb.Artifact, pb.ArtifactHeader, dict[str, float]]:
    """Lookup, Compile and the signature checks: the farm's part, network and protobuf only
    (safe on a pool thread). `inputs` choose among the key's entries by their guards. Also
    where the time went (GraphRecord.timings)."""
    request_id = uuid.uuid4().hex[:16]
    log.debug("%s: request %s", request.label, request_id)
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
    progress = ProgressLine(request.label, settings.progress)
    downloading = [0.0]

    def on_progress(event: pb.Progress) -> None:
        if event.stage == pb.Progress.DOWNLOADING:
            downloading[0] = time.monotonic()
        progress(event)

    try:
        header, data = remote.fetch(
            request, settings, on_progress=on_progress, request_id=request_id
        )
    finally:
        progress.close()
    timings = {f.name: v for f, v in header.timings.ListFields()}
    timings["transfer_s"] = time.monotonic() - downloading[0]
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
    return artifact, header, timings


def _load(
    artifact: pb.Artifact, options: pb.Options, device_index: int | None, timings: dict
) -> Callable:
    """The artifact's code, on the caller's CUDA device `device_index` (the payload named
    cuda:0, compiler/serialize.py); adds load_s to `timings`."""
    started = time.monotonic()
    compiled = load_artifact(
        artifact,
        cudagraphs=bool(config_patches(options).get("triton.cudagraphs")),
        device_index=device_index,
    )
    timings["load_s"] = time.monotonic() - started
    return lambda *args: compiled(*args)


def _compile_locally(
    gm,
    example_inputs,
    options: pb.Options,
    label: str,
    started: float,
    why: str = "",
    awaited: float | None = None,
) -> Callable:
    """Inductor here. At compile time (`awaited` None) a fake-tensor error of the kind Dynamo
    splits on goes to Dynamo; at a deferred graph's first call nothing can split any more,
    so the graph then runs eagerly."""
    deferred = awaited is not None

    def record(source: str) -> None:
        history.append(
            GraphRecord(
                label,
                source,
                time.monotonic() - started,
                why=why[-2000:],
                submitted=started,
                awaited=started if awaited is None else awaited,
                deferred=deferred,
            )
        )
        log.info("%s: %s in %.2f s (%s)", label, source, time.monotonic() - started, why)

    try:
        compiled = compile_locally(gm, example_inputs, config_patches(options))
        source = "local"
    except Exception as e:
        why = f"{why}; local: {type(e).__name__}: {e}"
        if isinstance(e, exceptions_allowed_to_be_fallback) and not deferred:
            record("split")  # handed back to Dynamo, which splits the graph as for Inductor
            raise
        compiled, source = _eager(gm, e), "eager"
    record(source)
    return compiled


def _eager(gm: torch.fx.GraphModule, e: Exception) -> Callable:
    _warn_once(f"local compile failed too ({type(e).__name__}: {e}); running eagerly")
    return gm.forward


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"torchfarm: {message}", RuntimeWarning, stacklevel=3)
