"""One Dynamo graph on its way through the client (`FarmGraph`): what every route of the
backend (blocking, deferred, no-wait, prepare, local) needs, carried as one object, with the
steps the routes share: asking the farm, fetching, loading, compiling locally, recording."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import torch

from torchfarm.client import fetch, records, remote
from torchfarm.client.fetch import Fetched, Question
from torchfarm.client.pool import Job, pool
from torchfarm.client.prefetch import program
from torchfarm.compiler import descriptor, guards, serialize, structure
from torchfarm.compiler.inductor import config_patches, load_artifact
from torchfarm.compiler.target import local_target
from torchfarm.contract.cache_key import key_parts, public_key
from torchfarm.errors import FarmError, UntrustedEntry
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings
from torchfarm.torch_adapter.compile.local_compile import (
    compile_locally,
    exceptions_allowed_to_be_fallback,
)
from torchfarm.torch_adapter.load import load_prewarm
from torchfarm.torch_adapter.trace.guard_text import hints, symbol_inputs

log = logging.getLogger("torchfarm")
# Called with each graph and its farm request: client/packages.py keeps them for the package
# that skips Dynamo's tracing in a later process.
request_observers: list[Callable[[torch.fx.GraphModule, pb.CompileRequest], None]] = []


@dataclasses.dataclass
class FarmGraph:
    """A graph Dynamo handed to the backend. `started` (time.monotonic()) is when it did;
    `request` and `timings` (payload_s, key_s) are set once the farm is asked."""

    gm: torch.fx.GraphModule
    example_inputs: list
    settings: ClientSettings
    options: pb.Options
    label: str
    started: float = dataclasses.field(default_factory=time.monotonic)
    request: pb.CompileRequest | None = None
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def inputs(self) -> list:
        """The placeholders' example values (FakeTensors and SymInts), as Dynamo traced them."""
        return serialize.example_inputs(self.gm)

    @functools.cached_property
    def device(self) -> str:
        """cuda if any input or intermediate value of the graph lives there (a graph may take
        CPU inputs and move them to the GPU), else cpu."""
        values = [n.meta.get("example_value") for n in self.gm.graph.nodes]
        for value in [*self.inputs, *values]:
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                return str(value.device)
        return "cpu"

    @functools.cached_property
    def device_index(self) -> int | None:
        """The CUDA device its code runs on (compiler/serialize.py)."""
        return serialize.local_device_index(self.gm)

    def ask(self, target: pb.Target | None = None) -> Question:
        """What to ask the farm, built on Dynamo's thread (pickling reads its ShapeEnv, and
        the program's positions follow Dynamo's order); for this process's target, shown to
        `request_observers`, unless `target` is given (client/prepare.py). A static graph is
        keyed by its descriptor, and its payload made on a miss only (at once where an
        observer keeps the request) by the fetch, which may run on a pool thread beside
        Dynamo: its pickler writes no process-wide state Dynamo guards on
        (torch_adapter/trace/graph_pickler.py); any other is keyed by its payload."""
        try:
            described = descriptor.describe(self.gm)
        except descriptor.Unsupported as e:
            log.debug("%s: keyed by its payload (%s)", self.label, e)
            described = b""
        observed = target is None and bool(request_observers)
        self.request = pb.CompileRequest(
            graph=serialize.dumps(self.gm) if observed or not described else b"",
            descriptor=described,
            target=target or local_target(self.device),
            options=self.options,
            label=self.label,
            private=self.settings.private,
            size_hints=serialize.size_hints(self.gm),
            float_hints=serialize.float_hints(self.gm),
        )
        if target is None:
            for observe in request_observers:
                observe(self.gm, self.request)
        payload_s = time.monotonic() - self.started
        ask = self._ask(self.request)
        self.timings = {
            "payload_s": payload_s,
            "key_s": time.monotonic() - self.started - payload_s,
        }
        return Question(self.request, ask, self.inputs, self.timings, self._payload)

    def _payload(self) -> bytes:
        """The payload, made on a miss (its time: miss_payload_s)."""
        started = time.monotonic()
        payload = serialize.dumps(self.gm)
        self.timings["miss_payload_s"] = time.monotonic() - started
        return payload

    def _ask(self, request: pb.CompileRequest) -> pb.Ask:
        """The Get ask: its key (computed here, as the gateway computes it), the sizes of the
        inputs' SymInts (the farm picks the entry whose guards hold on them), the key's parts
        (to explain a miss) and the graph's place in the program (prefetch)."""
        graph_key = public_key(request.graph, request.target, request.options, request.descriptor)
        return pb.Ask(
            key=graph_key,
            private=request.private,
            sizes=hints(symbol_inputs(self.inputs)),
            label=request.label,
            key_parts=key_parts(
                request.graph,
                request.target,
                request.options,
                structure.digest(self.gm),
                request.descriptor,
            ),
            program=program.place(graph_key),
        )

    def fetch(self, question: Question) -> Fetched:
        return fetch.fetch(question, self.settings)

    def submit(
        self, question: Question, heard: Callable[[pb.Progress], None] | None = None
    ) -> Job[Fetched]:
        """The fetch on the process's pool, over the one channel (made here once, shared)."""
        remote.channel(self.settings.addr, self.settings.tls_ca)
        size = max(self.settings.parallel_graphs, 1)
        return pool(size).submit(functools.partial(fetch.fetch, question, self.settings, heard))

    def install_guards(self, fetched: Fetched) -> None:
        """Into Dynamo's ShapeEnv, so that the graphs after this one trace under them."""
        if not guards.install(fetched.artifact.guards, self.inputs):
            raise FarmError("the artifact's shape guards do not hold for these inputs")

    def load(self, fetched: Fetched) -> Callable:
        return load_code(fetched.artifact, self.options, self.device_index, fetched.timings)

    def record_served(
        self, fetched: Fetched, awaited: float | None = None, deferred: bool = False
    ) -> None:
        records.add_served(
            dataclasses.replace(
                records.served(self.label, self.started, fetched, awaited), deferred=deferred
            )
        )

    def farm_failed(self, e: Exception, instead: str = "compiling locally") -> str:
        """Warns (once) that the graph is compiled locally (or what `instead` says) because of
        `e`; returns why, for the record."""
        if isinstance(e, UntrustedEntry):  # a miss: those bytes are never loaded
            records.warn_once(f"{e}; {instead}")
            return f"untrusted: {e}"
        log.info(
            "%s: farm failed after %.2f s (%s)", self.label, time.monotonic() - self.started, e
        )
        records.warn_once(f"farm unavailable ({e}); {instead}")
        return f"farm: {type(e).__name__}: {e}"

    def compile_locally(
        self, why: str = "", args: list | None = None, awaited: float | None = None
    ) -> Callable:
        """Inductor here, on `args` (default: the example inputs). At compile time (`awaited`
        None) a fake-tensor error of the kind Dynamo splits on goes to Dynamo; at a deferred
        graph's first call nothing can split any more, so the graph then runs eagerly."""
        deferred = awaited is not None
        try:
            compiled = compile_locally(
                self.gm, self.example_inputs if args is None else args, config_patches(self.options)
            )
            source = "local"
        except Exception as e:
            why = f"{why}; local: {type(e).__name__}: {e}"
            if isinstance(e, exceptions_allowed_to_be_fallback) and not deferred:
                self._record_local("split", why, awaited)  # Dynamo splits it as for Inductor
                raise
            records.warn_once(
                f"local compile failed too ({type(e).__name__}: {e}); running eagerly"
            )
            compiled, source = self.gm.forward, "eager"
        self._record_local(source, why, awaited)
        return compiled

    def _record_local(self, source: str, why: str, awaited: float | None) -> None:
        record = records.stamped(self.label, self.started, source, why)
        if awaited is not None:
            record = dataclasses.replace(record, awaited=awaited, deferred=True)
        records.history.append(record)
        log.info("%s: %s in %.2f s (%s)", self.label, source, record.seconds, why)


def load_code(
    artifact: pb.Artifact, options: pb.Options, device_index: int | None, timings: dict
) -> Callable:
    """The artifact's code, on the caller's CUDA device `device_index` (the payload named
    cuda:0, compiler/serialize.py); adds load_s to `timings`."""
    started = time.monotonic()
    load_prewarm.known_torch_key(artifact.torch_key)
    load_prewarm.wait()
    compiled = load_artifact(
        artifact,
        cudagraphs=bool(config_patches(options).get("triton.cudagraphs")),
        device_index=device_index,
        timings=timings,
    )
    timings["load_s"] = time.monotonic() - started
    return lambda *args: compiled(*args)
