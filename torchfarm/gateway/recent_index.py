"""A key's index entries as this gateway last read them, reused for TTL_S by the asks of a
hit storm (a fleet's ranks asking for the same keys at once) instead of a Redis round trip
per ask: that round trip was the largest part of the gateway's own CPU per hit.

Only the ask path reads it (Coordinator.get, the prefetch manifest), and only keys that had
entries are kept. What it can get wrong for TTL_S, and why that is safe:
- an entry added since (another shape of the same graph): no entry held, so Coordinator.get
  reads the key again before it answers a miss;
- an entry dropped since: its blob is gone too, so serving it fails its read and the next
  entry that holds is served, as for a corrupt blob.
Every blob served is still verified as before (read from the store, or kept by the gateway
after it was: VerifiedBlobs)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from torchfarm.proto import torchfarm_pb2 as pb

TTL_S = 1.0
MAX_KEYS = 4096


class RecentIndex:
    """`read(key)` (the store's entries of a key), remembered for `ttl_s` per key."""

    def __init__(
        self,
        read: Callable[[str], list[pb.EntryMeta]],
        ttl_s: float = TTL_S,
        max_keys: int = MAX_KEYS,
    ):
        self.read, self.ttl_s, self.max_keys = read, ttl_s, max_keys
        self._kept: collections.OrderedDict[str, tuple[float, list[pb.EntryMeta]]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def entries(self, key: str, fresh: bool = False) -> list[pb.EntryMeta]:
        """The entries as read at most `ttl_s` ago (`fresh`: read now)."""
        now = time.monotonic()
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None and now - kept[0] < self.ttl_s and not fresh:
                return kept[1]
        entries = self.read(key)
        if not entries:
            self.forget(key)
        else:
            with self._lock:
                self._kept[key] = (now, entries)
                self._kept.move_to_end(key)
                while len(self._kept) > self.max_keys:
                    self._kept.popitem(last=False)
        return entries

    def forget(self, key: str) -> None:
        with self._lock:
            self._kept.pop(key, None)
