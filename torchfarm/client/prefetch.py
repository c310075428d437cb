"""Prefetch on the client (issue 19 item 3): this process's graphs form a program, named by
its head (the public key of its first graph); every Ask says where its graph sits in it
(Program{head, position}). When the head hits, the farm sends a manifest of the graphs the
program needed last time; they are fetched at once, in parallel (TORCHFARM_PARALLEL_GRAPHS at a
time), and kept in memory by key until Dynamo reaches their graph, which then costs only its
load. A prefetched artifact is checked as any other (signature, then its guards on the graph's
inputs); one that fails is dropped and the graph is asked for as usual.

The fetches run on a pool of their own (client/pool.py: daemon threads; a fetch not started
when its graph is reached runs on the caller's thread), apart from the deferred graphs' pool,
so a graph waiting for a prefetch never waits behind itself.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from typing import TypeVar

from torchfarm.client.pool import Job, Pool
from torchfarm.proto import torchfarm_pb2 as pb

T = TypeVar("T")


class Program:
    """The graphs of this process in the order their keys were computed, and the fetches of
    a manifest, by key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._head = ""
        self._positions = itertools.count()
        self._fetches: dict[str, Job] = {}
        self._pool: Pool | None = None

    def place(self, key: str) -> pb.Program:
        """The next graph's place: the first key asked for is the program's head."""
        with self._lock:
            self._head = self._head or key
            return pb.Program(head=self._head, position=next(self._positions))

    def prefetch(
        self, manifest: pb.Manifest, fetch: Callable[[pb.ManifestEntry], T], parallel: int
    ) -> None:
        """Start fetching every entry of `manifest` not already fetched or taken."""
        with self._lock:
            if self._pool is None:
                self._pool = Pool(max(1, parallel))
            for entry in manifest.entries:
                if entry.key not in self._fetches:
                    self._fetches[entry.key] = self._pool.submit(functools.partial(fetch, entry))

    def take(self, key: str) -> Job | None:
        """The fetch of `key`'s prefetched entry, if any (at most once: it is then forgotten)."""
        with self._lock:
            return self._fetches.pop(key, None)


program = Program()  # this process's
