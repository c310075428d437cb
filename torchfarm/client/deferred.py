"""A static graph fetched in the background: the backend returns at once, so that the graphs
Dynamo hands over before running any (DDPOptimizer's buckets) compile in parallel."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from torchfarm.client.fetch import Fetched
from torchfarm.client.graph import FarmGraph
from torchfarm.client.pool import Job
from torchfarm.compiler import guards
from torchfarm.errors import FarmError


class DeferredGraph:
    """The code of a graph fetched in the background. The first call waits for the fetch,
    checks that the artifact's shape guards hold for the real inputs, and loads it on the
    calling thread (as the blocking path does; loading is not proven thread-safe); a farm
    failure compiles the graph locally right then (or runs it eagerly), with the one warning."""

    def __init__(self, graph: FarmGraph, job: Job[Fetched]):
        self._graph: FarmGraph | None = graph
        self._job = job
        self._compiled: Callable | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    self._compiled = self._resolve(list(args))
        return self._compiled(*args)

    def _resolve(self, args: list) -> Callable:
        awaited = time.monotonic()
        graph, self._graph = self._graph, None  # nothing of it is kept once its code is ready
        assert graph is not None
        try:
            fetched = self._job.result()
            if not guards.hold(fetched.artifact.guards, args):
                raise FarmError("the artifact's shape guards do not hold for these inputs")
            compiled = graph.load(fetched)
        except Exception as e:  # the farm must never break training
            why = graph.farm_failed(e)
            return graph.compile_locally(why, args, awaited)
        graph.record_served(fetched, awaited, deferred=True)
        return compiled
