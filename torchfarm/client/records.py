"""What happened to each graph: one GraphRecord per graph in `history`, built here only."""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings

from torchfarm.client.fetch import Fetched

log = logging.getLogger("torchfarm")
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
    # miss (queued_s, handoff_s, child_s, compile_s, store_s; backward_at_s, backward_wait_s,
    # backward_load_s and helper_began_s, helper_lowered_s, helper_compiled_s where the
    # backward was the helper's); here payload_s (the graph
    # serialized, target and options included), key_s, rpc_s (Get sent -> header; a miss's
    # compile included), transfer_s (header -> last chunk, decompress_s included),
    # wire_bytes (chunk bytes received), verify_s (the signature), load_s
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    explanation: str = ""  # a farm miss: why, in words (client/explain.py)
    # a hit fetched ahead of need, on the manifest of the program's first graph (prefetch.py)
    prefetched: bool = False


# Every graph this process compiled, in the order their code became ready; for logs, the demo
# and tests.
history: list[GraphRecord] = []


def stamped(label: str, started: float, source: str, why: str = "") -> GraphRecord:
    """The record of a graph the farm did not serve, given to the backend at `started`
    (time.monotonic()), its code ready (or given up on) now."""
    return GraphRecord(
        label,
        source,
        time.monotonic() - started,
        why=why[-2000:],
        submitted=started,
        awaited=started,
    )


def served(
    label: str, started: float, fetched: Fetched, awaited: float | None = None
) -> GraphRecord:
    """The record of a graph the farm served, its code first needed at `awaited` (default:
    `started`, when the backend got it)."""
    header = fetched.header
    return GraphRecord(
        label,
        header.source,
        time.monotonic() - started,
        header.size,
        header.key,
        header.digest,
        job_id=header.job_id,
        submitted=started,
        awaited=started if awaited is None else awaited,
        timings=fetched.timings,
        explanation=fetched.explanation,
        prefetched=fetched.prefetched,
    )


def add_served(record: GraphRecord) -> None:
    history.append(record)
    log.info(
        "%s: farm %s%s in %.2f s (waited %.2f s), %d bytes, key %s%s%s",
        record.label,
        record.source,
        " (prefetched)" if record.prefetched else "",
        record.seconds,
        time.monotonic() - record.awaited,
        record.bytes,
        record.key[:16],
        f", job {record.job_id}" if record.job_id else "",
        f"; {record.explanation}" if record.explanation else "",
    )


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"torchfarm: {message}", RuntimeWarning, stacklevel=3)
