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
from typing import NamedTuple

import torch

from torchfarm import signing, torch_adapter
from torchfarm.client import explain, prepare, remote, switching
from torchfarm.client.pool import Job, pool
from torchfarm.client.prefetch import program
from torchfarm.client.progress import ProgressLine
from torchfarm.compiler import guards, serialize, structure, trace_state
from torchfarm.compiler.inductor import config_patches, load_artifact
from torchfarm.compiler.target import local_target
from torchfarm.contract import modes
from torchfarm.contract.cache_key import key_parts, public_key
from torchfarm.errors import FarmError, UntrustedEntry
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings
from torchfarm.torch_adapter import fake_device, load_prewarm
from torchfarm.torch_adapter.deferrable import deferrable
from torchfarm.torch_adapter.guard_text import hints, symbol_inputs
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
    job_id: str = ""  # a farm miss or merge: the compile's job, as the farm's logs name it
    why: str = ""  # for local and eager: why the farm (and local compile) did not serve it
    submitted: float = 0.0
    awaited: float = 0.0
    deferred: bool = False
    # no-wait mode (client/switching.py): source "eager-while-compiling" when the graph starts
    # running eagerly; then the record of the code it switched to (`switched`, monotonic; 0:
    # none) or of the eager graph it stays (a failing farm), with the calls that ran eagerly
    eager_calls: int = 0
    switched: float = 0.0
    # farm graphs: where the time went (seconds, and wire_bytes): the worker's MissTimings on a
    # miss (queued_s, handoff_s, child_s, compile_s, store_s); here payload_s (the graph
    # serialized, target and options included), key_s, rpc_s (Get sent -> header; a miss's
    # compile included), transfer_s (header -> last chunk, decompress_s included),
    # wire_bytes (chunk bytes received), verify_s (the signature), load_s
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    explanation: str = ""  # a farm miss: why, in words (client/explain.py)
    # a hit fetched ahead of need, on the manifest of the program's first graph (prefetch.py)
    prefetched: bool = False


class Fetched(NamedTuple):
    """A graph's artifact from the farm, verified, and what came with it."""

    artifact: pb.Artifact
    header: pb.ArtifactHeader
    timings: dict[str, float]
    explanation: str = ""  # a miss: why the farm had no entry for it
    prefetched: bool = False  # fetched ahead of need (client/prefetch.py)


# Every graph this process compiled, in the order their code became ready; for logs, the demo
# and tests.
history: list[GraphRecord] = []
# Called with each graph and its farm request: client/packages.py keeps them for the package
# that skips Dynamo's tracing in a later process.
request_observers: list[Callable[[torch.fx.GraphModule, pb.CompileRequest], None]] = []
# Dynamo imports this module when torch.compile names the backend: the one-time work of the
# first load (in no-wait mode from the second step: client/switching.py), the connection to
# the farm, its keys and the target's probes start now and overlap the tracing of the first
# graph.
load_prewarm.start(defer=not ClientSettings.from_env().wait)
remote.connect_early(ClientSettings.from_env(), local_target)


def torchfarm_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    mode: str | None = None,
    options: dict | None = None,
    *,
    addr: str | None = None,
    token: str | None = None,
    wait: bool | None = None,
) -> Callable:
    """Compile one Dynamo graph on the farm; `options` are Inductor config patches.

    A static graph of torch's own operators (torch_adapter/deferrable.py: nothing to install
    into Dynamo's ShapeEnv, no split to hand to Dynamo) is fetched in the background and the
    call returns at once, so that the graphs Dynamo hands over before running any
    (DDPOptimizer's buckets) compile in parallel; its first call waits for it. Any other
    graph blocks here, as before. With `wait` False (TORCHFARM_WAIT=0) a graph that the farm
    does not serve at once runs eagerly until its code arrives (client/switching.py)."""
    settings = ClientSettings.from_env(addr=addr, token=token, wait=wait)
    farm_options = pb.Options(
        mode=modes.named(mode),
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
    prepared_for = prepare.target()
    if prepared_for is not None:
        return _prepare(gm, settings, farm_options, label, started, prepared_for)
    return _compile_graph(gm, example_inputs, settings, farm_options, label, started)


def _compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    settings: ClientSettings,
    farm_options: pb.Options,
    label: str,
    started: float,
) -> Callable:
    """One graph's code from the farm (or compiled here, or eager)."""
    inputs = serialize.example_inputs(gm)
    try:
        request, ask, before = _asked(gm, settings, farm_options, label, started)
        if not settings.wait:
            request.label = f"{label} (eager while compiling)"  # what the progress line shows
            answer = switching.FarmAnswer()
            remote.channel(settings.addr, settings.tls_ca)
            job = pool(max(settings.parallel_graphs, 1)).submit(
                functools.partial(_fetch, request, ask, settings, inputs, before, answer.heard)
            )
            if not answer.serves(job):
                return _eager_while_compiling(
                    gm, example_inputs, job, farm_options, label, started, settings
                )
            fetched = job.result()  # a hit: served as in wait mode
        elif settings.parallel_graphs and deferrable(gm):
            remote.channel(settings.addr, settings.tls_ca)  # made here once, shared by all
            job = pool(settings.parallel_graphs).submit(
                functools.partial(_fetch, request, ask, settings, inputs, before)
            )
            log.debug("%s: submitted", label)
            return DeferredGraph(gm, job, farm_options, label, started)
        else:
            fetched = _fetch(request, ask, settings, inputs, before)
        artifact, timings = fetched.artifact, fetched.timings
        if not guards.install(artifact.guards, inputs):
            raise FarmError("the artifact's shape guards do not hold for these inputs")
        compiled = _load(artifact, farm_options, serialize.local_device_index(gm), timings)
    except Exception as e:  # the farm must never break training
        if not settings.wait:  # nor make it wait: handled at the first call, as a later failure
            failed: Job = Job(lambda: None)
            failed.future.set_exception(e)
            return _eager_while_compiling(
                gm, example_inputs, failed, farm_options, label, started, settings
            )
        why = _farm_failed(e, label, started)
        return _compile_locally(gm, example_inputs, farm_options, label, started, why=why)
    _record_farm(label, fetched, started, started)
    return compiled


# A preparation's graphs fetched in the background (static ones, as DeferredGraph's): label,
# submission time and fetch; finish_prepared records them.
_prepared: list[tuple[str, float, Job[Fetched]]] = []


def _prepare(
    gm: torch.fx.GraphModule,
    settings: ClientSettings,
    options: pb.Options,
    label: str,
    started: float,
    target: pb.Target,
) -> Callable:
    """`torchfarm prepare` (client/prepare.py): the farm compiles the graph for `target` (or
    holds it already); nothing is loaded, and the graph runs on the fake tensors it was traced
    on. Its shape guards are installed as in a real run, so the graphs after it are traced
    from the same ShapeEnv. A static graph is fetched in the background (DDP's buckets compile
    at once); a failure is recorded, never compiled here."""
    fake_device.as_traced_for_real(gm)
    request = _request(gm, settings, options, label, _target_for(target, _device_of(gm)))
    inputs = serialize.example_inputs(gm)
    ask = _ask(gm, request, inputs)
    before = {"payload_s": time.monotonic() - started}
    fetch = functools.partial(_fetch, request, ask, settings, inputs, before)
    if deferrable(gm):
        _prepared.append((label, started, pool(max(settings.parallel_graphs, 1)).submit(fetch)))
        return gm.forward
    try:
        fetched = fetch()
        if not guards.install(fetched.artifact.guards, inputs):
            raise FarmError("the artifact's shape guards do not hold for these inputs")
        _record_farm(label, fetched, started, started)
    except Exception as e:
        _record_unprepared(label, started, e)
    return gm.forward


def finish_prepared() -> None:
    """Wait for the preparation's background fetches and record each."""
    while _prepared:
        label, started, job = _prepared.pop(0)
        try:
            _record_farm(label, job.result(), started, started, deferred=True)
        except Exception as e:
            _record_unprepared(label, started, e)


def _record_unprepared(label: str, started: float, e: Exception) -> None:
    why = f"farm: {type(e).__name__}: {e}"
    history.append(
        GraphRecord(label, "failed", time.monotonic() - started, why=why, submitted=started)
    )
    log.warning("%s: not prepared (%s)", label, why)


def _target_for(target: pb.Target, device: str) -> pb.Target:
    """The prepared job's target for a graph on `device`: a CPU graph of a CUDA job runs on
    that machine's CPU, which the target describes too (compiler/target.py)."""
    kind = torch.device(device).type
    if kind == target.device:
        return target
    if kind != "cpu":
        raise FarmError(f"a {kind} graph in a job prepared for {target.device}")
    cpu = pb.Target()
    cpu.CopyFrom(target)
    cpu.device = "cpu"
    cpu.ClearField("cuda_capability")
    cpu.ClearField("cuda_version")
    cpu.ClearField("triton_version")
    return cpu


def _eager_while_compiling(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    job: Job,
    options: pb.Options,
    label: str,
    submitted: float,
    settings: ClientSettings,
) -> switching.SwitchingGraph:
    """No-wait mode: the graph runs eagerly until `job` (the farm's fetch) brings its code;
    on a farm failure it stays eager (no local compile: docs/architecture.md, "Never wait")."""
    history.append(
        GraphRecord(label, "eager-while-compiling", 0.0, submitted=submitted, awaited=submitted)
    )
    log.info("%s: running eagerly while the farm compiles it", label)
    resolve = functools.partial(
        _farm_code, options, serialize.local_device_index(gm), label, submitted, settings.progress
    )
    inputs = serialize.example_inputs(gm)
    return switching.SwitchingGraph(
        gm, inputs, job, resolve, label, after_first_call=load_prewarm.resume
    )


def _farm_code(
    options: pb.Options,
    device_index: int | None,
    label: str,
    submitted: float,
    progress: bool,
    job: Job,
    graph: switching.SwitchingGraph,
) -> switching.Switch | None:
    """A no-wait graph's fetch is done: its loaded artifact to switch to; or, on a failure,
    None: the graph stays eager (one warning)."""
    try:
        fetched = job.result()
        artifact = fetched.artifact
        compiled = _load(artifact, options, device_index, fetched.timings)
    except Exception as e:  # the farm must never break training, nor make it wait
        why = _farm_failed(e, label, submitted, instead="running eagerly")
        _stays_eager(label, submitted, graph, why)
        return None
    _record_farm(label, fetched, submitted, submitted, eager_calls=graph.eager_calls, switched=True)
    switching.announce(
        f"{label}: switched to the farm's code after {graph.eager_calls} eager calls", progress
    )
    return compiled, artifact.guards


def _stays_eager(label: str, submitted: float, graph: switching.SwitchingGraph, why: str) -> None:
    history.append(
        GraphRecord(
            label,
            "eager",
            time.monotonic() - submitted,
            why=why[-2000:],
            submitted=submitted,
            awaited=submitted,
            eager_calls=graph.eager_calls,
        )
    )
    log.info("%s: eager (%s)", label, why)


class DeferredGraph:
    """The code of a graph fetched in the background. The first call waits for the fetch,
    checks that the artifact's shape guards hold for the real inputs, and loads it on the
    calling thread (as the blocking path does; loading is not proven thread-safe); a farm
    failure compiles the graph locally right then (or runs it eagerly), with the one warning."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        job: Job[Fetched],
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
            fetched = self._job.result()
            artifact, timings = fetched.artifact, fetched.timings
            if not guards.hold(artifact.guards, args):
                raise FarmError("the artifact's shape guards do not hold for these inputs")
            compiled = _load(artifact, self._options, self._device_index, timings)
        except Exception as e:  # the farm must never break training
            why = _farm_failed(e, self._label, self._submitted)
            return _compile_locally(
                gm, args, self._options, self._label, self._submitted, why=why, awaited=awaited
            )
        _record_farm(self._label, fetched, self._submitted, awaited, deferred=True)
        return compiled


def _record_farm(
    label: str,
    fetched: Fetched,
    submitted: float,
    awaited: float,
    deferred=False,
    eager_calls: int = 0,
    switched: bool = False,
) -> None:
    header = fetched.header
    record = GraphRecord(
        label,
        header.source,
        time.monotonic() - submitted,
        header.size,
        header.key,
        header.digest,
        job_id=header.job_id,
        submitted=submitted,
        awaited=awaited,
        deferred=deferred,
        eager_calls=eager_calls,
        switched=time.monotonic() if switched else 0.0,
        timings=fetched.timings,
        explanation=fetched.explanation,
        prefetched=fetched.prefetched,
    )
    history.append(record)
    log.info(
        "%s: farm %s%s in %.2f s (waited %.2f s), %d bytes, key %s%s%s",
        label,
        record.source,
        " (prefetched)" if record.prefetched else "",
        record.seconds,
        time.monotonic() - awaited,
        record.bytes,
        header.key[:16],
        f", job {record.job_id}" if record.job_id else "",
        f"; {record.explanation}" if record.explanation else "",
    )


def _farm_failed(
    e: Exception, label: str, started: float, instead: str = "compiling locally"
) -> str:
    """Warns (once) that a graph is compiled locally (or what `instead` says) because of `e`;
    returns why, for the record."""
    if isinstance(e, UntrustedEntry):  # a miss: those bytes are never loaded
        _warn_once(f"{e}; {instead}")
        return f"untrusted: {e}"
    log.info("%s: farm failed after %.2f s (%s)", label, time.monotonic() - started, e)
    _warn_once(f"farm unavailable ({e}); {instead}")
    return f"farm: {type(e).__name__}: {e}"


def _device_of(gm: torch.fx.GraphModule) -> str:
    """cuda if any input or intermediate value of the graph lives there (a graph may take CPU
    inputs and move them to the GPU), else cpu."""
    values = [n.meta.get("example_value") for n in gm.graph.nodes]
    for value in [*serialize.example_inputs(gm), *values]:
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            return str(value.device)
    return "cpu"


def _request(gm, settings, options, label, target: pb.Target | None = None) -> pb.CompileRequest:
    """The graph's Compile request, built on Dynamo's thread (pickling reads its ShapeEnv);
    for this process's target unless `target` is given (client/prepare.py)."""
    return pb.CompileRequest(
        graph=serialize.dumps(gm),
        target=target or local_target(_device_of(gm)),
        options=options,
        label=label,
        private=settings.private,
        size_hints=serialize.size_hints(gm),
    )


def _asked(
    gm: torch.fx.GraphModule,
    settings: ClientSettings,
    options: pb.Options,
    label: str,
    started: float,
) -> tuple[pb.CompileRequest, pb.Ask, dict[str, float]]:
    """The graph's request (shown to `request_observers`), its Ask, and what they cost
    (payload_s, key_s since `started`)."""
    request = _request(gm, settings, options, label)
    for observe in request_observers:
        observe(gm, request)
    payload_s = time.monotonic() - started
    ask = _ask(gm, request, serialize.example_inputs(gm))
    return request, ask, {"payload_s": payload_s, "key_s": time.monotonic() - started - payload_s}


def _ask(gm: torch.fx.GraphModule, request: pb.CompileRequest, inputs: list) -> pb.Ask:
    """The graph's Get ask: its key (computed here, as the gateway computes it), the sizes of
    `inputs`' SymInts (the farm picks the entry whose guards hold on them), the key's parts
    (to explain a miss) and the graph's place in the program (prefetch). Built on Dynamo's
    thread, so positions follow Dynamo's order."""
    graph_key = public_key(request.graph, request.target, request.options)
    return pb.Ask(
        key=graph_key,
        private=request.private,
        sizes=hints(symbol_inputs(inputs)),
        label=request.label,
        key_parts=key_parts(request.graph, request.target, request.options, structure.digest(gm)),
        program=program.place(graph_key),
    )


def _fetch(
    request: pb.CompileRequest,
    ask: pb.Ask,
    settings: ClientSettings,
    inputs: list,
    before: dict[str, float],
    heard: Callable[[pb.Progress], None] | None = None,
) -> Fetched:
    """The graph's artifact: prefetched (its guards holding on `inputs`), else one Get; and
    the signature check. The farm's part, network and protobuf only (safe on a pool thread);
    the payload goes only on a miss. Also where the time went (GraphRecord.timings; `before`:
    payload_s and key_s). `heard` sees every progress event (no-wait mode tells a hit,
    DOWNLOADING, from a compile, QUEUED on `missing`, by the first)."""
    prefetched = _prefetched(ask, inputs)
    if prefetched is not None:
        prefetched.timings.update(before)
        if heard:
            heard(pb.Progress(stage=pb.Progress.DOWNLOADING))
        return prefetched
    request_id = uuid.uuid4().hex[:16]
    log.debug("%s: request %s", request.label, request_id)
    # Signing: nothing from the farm is evaluated or loaded unless a trusted key signed it.
    trusted = remote.verifier(settings, request_id)
    progress = ProgressLine(request.label, settings.progress)

    def on_progress(event: pb.Progress) -> None:
        if heard:
            heard(event)
        progress(event)

    try:
        received = remote.get(
            ask,
            request,
            settings,
            on_progress=on_progress,
            request_id=request_id,
            on_manifest=functools.partial(_prefetch, settings),
        )
    finally:
        progress.close()
    explanation = ""
    if received.missing is not None:
        explanation = explain.describe(
            received.missing.explanation, request.target, request.options
        )
        explain.remember(request.label, ask.key, explanation)
        log.info("%s: %s", request.label, explanation)
    fetched = _verified(received, ask.key, trusted)
    fetched.timings.update(before)
    return fetched._replace(explanation=explanation)


def _verified(received: remote.Received, graph_key: str, trusted: signing.Verifier) -> Fetched:
    """The artifact of `received` once a trusted key has signed it for `graph_key`."""
    header = received.header
    started = time.monotonic()
    artifact = remote.verified_artifact(received, graph_key, trusted)
    timings = {f.name: v for f, v in header.timings.ListFields()}
    timings.update(received.timings)
    timings["verify_s"] = time.monotonic() - started
    return Fetched(artifact, header, timings)


def _prefetch(settings: ClientSettings, manifest: pb.Manifest) -> None:
    """The program's head hit: fetch the graphs that followed it last time, in the background."""
    log.info("prefetching %d graphs of this program", len(manifest.entries))
    program.prefetch(manifest, functools.partial(_fetch_entry, settings), settings.parallel_graphs)


def _fetch_entry(settings: ClientSettings, entry: pb.ManifestEntry) -> Fetched:
    """One manifest entry, by key and digest (no payload: a miss ends the call), verified."""
    request_id = uuid.uuid4().hex[:16]
    ask = pb.Ask(
        key=entry.key,
        digest=entry.digest,
        private=settings.private,
        label=f"prefetch {entry.position}",
    )
    received = remote.get(ask, None, settings, request_id=request_id)
    return _verified(received, entry.key, remote.verifier(settings, request_id))


def _prefetched(ask: pb.Ask, inputs: list) -> Fetched | None:
    """The prefetched artifact of `ask.key` if its guards hold on `inputs`; None (logged) if
    there is none, its fetch failed or its guards fail: then the graph is asked for."""
    job = program.take(ask.key)
    if job is None:
        return None
    try:
        fetched = job.result()
    except Exception as e:
        log.info("%s: prefetch failed (%s); asking the farm", ask.label, e)
        return None
    if not guards.hold(fetched.artifact.guards, inputs):
        log.info("%s: the prefetched entry's guards fail here; asking the farm", ask.label)
        return None
    return fetched._replace(prefetched=True)


def _load(
    artifact: pb.Artifact, options: pb.Options, device_index: int | None, timings: dict
) -> Callable:
    """The artifact's code, on the caller's CUDA device `device_index` (the payload named
    cuda:0, compiler/serialize.py); adds load_s to `timings`."""
    started = time.monotonic()
    load_prewarm.wait()
    compiled = load_artifact(
        artifact,
        cudagraphs=bool(config_patches(options).get("triton.cudagraphs")),
        device_index=device_index,
        timings=timings,
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
