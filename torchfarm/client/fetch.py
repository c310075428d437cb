"""A graph's artifact from the farm: prefetched, else one Get; verified before anything of it
is used. Network and protobuf only, so it runs on a pool thread (client/pool.py), but for a
static graph's payload made on a miss (no ShapeEnv in it: client/graph.py)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import NamedTuple

from torchfarm import signing
from torchfarm.client import explain, remote
from torchfarm.client.prefetch import program
from torchfarm.client.progress import ProgressLine
from torchfarm.compiler import guards
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings

log = logging.getLogger("torchfarm")


class Fetched(NamedTuple):
    """A graph's artifact from the farm, verified, and what came with it."""

    artifact: pb.Artifact
    header: pb.ArtifactHeader
    timings: dict[str, float]
    explanation: str = ""  # a miss: why the farm had no entry for it
    prefetched: bool = False  # fetched ahead of need (client/prefetch.py)


@dataclasses.dataclass(frozen=True)
class Question:
    """What the farm is asked for one graph: its Ask, the request sent only on a miss, the
    inputs its guards must hold on, and what building them cost (payload_s, key_s). A
    request keyed by its descriptor may come without its payload: `payload` makes it, on a
    miss only."""

    request: pb.CompileRequest
    ask: pb.Ask
    inputs: list
    before: dict[str, float]
    payload: Callable[[], bytes] | None = None


def fetch(
    question: Question,
    settings: ClientSettings,
    heard: Callable[[pb.Progress], None] | None = None,
) -> Fetched:
    """The graph's artifact: prefetched (its guards holding on the inputs), else one Get; and
    the signature check. Also where the time went (GraphRecord.timings). `heard` sees every
    progress event (no-wait mode tells a hit, DOWNLOADING, from a compile, QUEUED on
    `missing`, by the first)."""
    request, ask = question.request, question.ask
    found = prefetched(ask, question.inputs)
    if found is not None:
        found.timings.update(question.before)
        if heard:
            heard(pb.Progress(stage=pb.Progress.DOWNLOADING))
        return found
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
        listeners = remote.Listeners(
            request_id, on_progress, functools.partial(_prefetch, settings)
        )
        received = remote.get(ask, request, settings, listeners, question.payload)
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
    fetched.timings.update(question.before)
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
    received = remote.get(ask, None, settings, remote.Listeners(request_id))
    return _verified(received, entry.key, remote.verifier(settings, request_id))


def prefetched(ask: pb.Ask, inputs: list) -> Fetched | None:
    """The prefetched artifact of `ask.key` if its guards hold on `inputs`; None (logged) if
    there is none, its fetch failed or its guards fail: then the graph is asked for."""
    job = program.take(ask.key)
    if job is None:
        return None
    try:
        fetched: Fetched = job.result()
    except Exception as e:
        log.info("%s: prefetch failed (%s); asking the farm", ask.label, e)
        return None
    if not guards.hold(fetched.artifact.guards, inputs):
        log.info("%s: the prefetched entry's guards fail here; asking the farm", ask.label)
        return None
    return fetched._replace(prefetched=True)
