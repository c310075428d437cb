"""A few background threads that fetch graphs from the farm while Dynamo goes on.

Each job is one graph's farm work (lookup, Compile stream, signature check) on the shared
gRPC channel. The threads are daemons, unlike concurrent.futures' (which the interpreter
joins at exit): a process that exits with graphs in flight does not wait for them.
A job that no thread has started yet when its graph is needed runs on the caller's thread,
so a full pool never makes a graph wait behind ones that are needed later.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class Job(Generic[T]):
    """One submitted call; `result()` waits for it, or runs it here if it has not started."""

    def __init__(self, fn: Callable[[], T]):
        self.fn = fn
        self.future: Future[T] = Future()

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # taken over by the caller (see result)
        try:
            self.future.set_result(self.fn())
        except BaseException as e:  # handed to whoever waits for the graph
            self.future.set_exception(e)

    def result(self) -> T:
        if self.future.cancel():
            return self.fn()
        return self.future.result()


class Pool:
    """At most `size` jobs at once; more wait in a queue, in submission order."""

    def __init__(self, size: int):
        self.size = size
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> Job[T]:
        job = Job(fn)
        self._jobs.put(job)
        with self._lock:  # threads start on demand and then stay, waiting for jobs
            if len(self._threads) < self.size:
                thread = threading.Thread(
                    target=self._work, daemon=True, name=f"torchfarm-graph-{len(self._threads)}"
                )
                self._threads.append(thread)
                thread.start()
        return job

    def _work(self) -> None:
        while True:
            self._jobs.get().run()


@functools.cache
def pool(size: int) -> Pool:
    """The process's pool for this size (TORCHFARM_PARALLEL_GRAPHS)."""
    return Pool(size)
