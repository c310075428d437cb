"""The compiles this worker process runs: how many, since when a slot has been free (what its
heartbeat reports, so that a job's waiters can tell a job waiting its turn from one lost in the
queue: cache/pools.py PoolState.took_nothing_since), and a wait for none to run (the pool's
kernel builds start only then: workers/kernel_builder.py)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


class Slots:
    def __init__(self) -> None:
        self.concurrency = 1
        self.running = 0
        self.free_since = time.monotonic()
        self.changed = threading.Condition()

    @contextlib.contextmanager
    def taken(self) -> Iterator[None]:
        with self.changed:
            self.running += 1
        try:
            yield
        finally:
            with self.changed:
                self.running -= 1
                if self.running == self.concurrency - 1:  # a slot has just come free
                    self.free_since = time.monotonic()
                self.changed.notify_all()

    def free_for_s(self) -> float:
        """Seconds this worker has had a free slot without a break; -1 while all are busy."""
        with self.changed:
            return -1.0 if self.running >= self.concurrency else time.monotonic() - self.free_since

    def wait_until_none_run(self) -> None:
        """Return once no compile runs (at once where none does)."""
        with self.changed:
            self.changed.wait_for(lambda: self.running == 0)


SLOTS = Slots()  # the compile tasks of this worker process
