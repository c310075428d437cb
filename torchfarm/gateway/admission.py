"""What a stream may hold of the gateway: a slot (per tenant and in all) and a deadline on
each message it is waited for.

gRPC's sync server gives every RPC a thread for its whole life, and a request stream's read
blocks that thread until the client sends. So a stream that waits (for a message, for a
compile, for a slow reader) holds a thread; slots bound how many threads waiting streams can
hold, leaving the rest for everyone's short calls, and deadlines end a silent stream.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import grpc

from torchfarm.contract import busy

log = logging.getLogger("torchfarm.gateway")
UNAUTHENTICATED_STREAMS = " no token"  # the slot owner of health and reflection streams
# (a leading space: no tenant name has one)
T = TypeVar("T")


class StreamSlots:
    """Open streams per owner (a tenant) and in all. Each owner holds at most its share
    (`per_tenant`), and the last `reserve` free slots go only to owners that hold none, so a
    tenant's first stream finds a slot however many others hold their share. Past a cap a
    stream is refused at once (RESOURCE_EXHAUSTED): it never waits for a thread that
    another's streams hold."""

    def __init__(self, total: int, per_tenant: int):
        self.total, self.per_tenant = total, per_tenant
        self.reserve = min(max(1, per_tenant // 8), total - per_tenant)
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, owner: str) -> tuple[str, str] | None:
        """None if a slot was taken (give it back), else (whose capacity is spent: busy.TENANT
        or busy.GATEWAY, why)."""
        with self._lock:
            mine = self._open.get(owner, 0)
            if mine >= self.per_tenant:
                return busy.TENANT, f"this tenant has {mine} streams open, the most it may have"
            free = self.total - sum(self._open.values())
            if free <= (self.reserve if mine else 0):
                return busy.GATEWAY, f"the gateway has no stream free for {owner.strip()}"
            self._open[owner] = mine + 1
            return None

    def give(self, owner: str) -> None:
        with self._lock:
            left = self._open[owner] - 1
            if left:
                self._open[owner] = left
            else:
                del self._open[owner]

    @contextmanager
    def held(self, owner: str, context) -> Iterator[None]:
        """A slot for the body, or the RPC ends RESOURCE_EXHAUSTED now, saying when to ask
        again and whose capacity was spent (contract/busy.py)."""
        refused = self.take(owner)
        if refused is not None:
            scope, why = refused
            context.set_trailing_metadata(
                ((busy.RETRY_AFTER_MS, str(busy.STREAM_RETRY_AFTER_MS)), (busy.SCOPE, scope))
            )
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{why}; retry later")
            raise AssertionError("context.abort returned")
        try:
            yield
        finally:
            self.give(owner)


class MessageDeadlines:
    """Reads of a request stream with a deadline. A late message cancels the RPC: that is
    what wakes gRPC's blocked read (it raises) and frees the handler's thread; the client
    sees CANCELLED. One timer thread for all streams: a thread per wait would cost what
    the deadline saves."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._due: list[tuple[float, int, list]] = []  # (when, seq, [context or None])
        self._seq = itertools.count()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def next(self, requests: Iterator[T], context, what: str) -> T | None:
        """The stream's next message, None at its end; cancels the RPC past the deadline."""
        armed = [context, what]
        with self._wake:
            heapq.heappush(self._due, (time.monotonic() + self.timeout_s, next(self._seq), armed))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="message-deadlines", daemon=True
                )
                self._thread.start()
            if self._due[0][2] is armed:  # due before all others: the timer must wake sooner
                self._wake.notify()
        try:
            return next(requests, None)
        finally:
            armed[0] = None  # disarmed; the timer drops it when its time comes

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._wake.wait(self._due[0][0] - time.monotonic() if self._due else None)
                _, _, armed = heapq.heappop(self._due)
                context, what = armed
            if context is not None:
                log.info("no %s within %g s: the stream is cancelled", what, self.timeout_s)
                context.cancel()


class StreamsWithoutToken(grpc.ServerInterceptor):
    """Streams of the services that take no token (health's Watch, reflection) hold slots of
    a small pool of their own (`slots`, owner UNAUTHENTICATED_STREAMS), apart from the
    tenants': strangers can hold no thread a tenant's stream could use. The Farm service's
    streams take their tenant's slots themselves."""

    def __init__(self, slots: StreamSlots, services: tuple[str, ...]):
        self.slots = slots
        self.prefixes = tuple(f"/{service}/" for service in services)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefixes):
            return handler
        field = (
            "unary_stream"
            if handler.unary_stream
            else "stream_stream"
            if handler.stream_stream
            else None
        )
        if field is None:
            return handler
        behavior = getattr(handler, field)

        def held(request, context):
            with self.slots.held(UNAUTHENTICATED_STREAMS, context):
                yield from behavior(request, context)

        return handler._replace(**{field: held})
