"""One progress line on stderr for farm waits over ~2 s (TTY only), shared by every graph
in flight: "graph 3: compiling 12.0 s" for one, "6 graphs: 4 compiling, 2 queued 12.0 s"
for several (graphs compile in parallel, client/pool.py)."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter

from torchfarm.proto import torchfarm_pb2 as pb

SHOW_AFTER_S = 2.0


class _Board:
    """The graphs being waited for, their stages, and whether the line is on screen."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stages: dict[str, str] = {}
        self.started: float | None = None  # when the oldest graph in flight began
        self.shown = False

    def update(self, label: str, stage: str) -> None:
        with self.lock:
            self.stages[label] = stage
            if self.started is None:
                self.started = time.monotonic()
            elapsed = time.monotonic() - self.started
            if elapsed < SHOW_AFTER_S:
                return
            if len(self.stages) == 1:
                text = f"{label}: {stage}"
            else:
                counts = Counter(self.stages.values()).most_common()
                text = f"{len(self.stages)} graphs: " + ", ".join(f"{n} {s}" for s, n in counts)
            sys.stderr.write(f"\r\033[K[torchfarm] {text} {elapsed:5.1f} s ")
            sys.stderr.flush()
            self.shown = True

    def remove(self, label: str) -> None:
        with self.lock:
            self.stages.pop(label, None)
            if self.stages:
                return
            self.started = None
            if self.shown:
                sys.stderr.write("\n")
                sys.stderr.flush()
                self.shown = False


_board = _Board()


class ProgressLine:
    """One graph's part of the line: call it with each Progress event, close it when done."""

    def __init__(self, label: str, enabled: bool):
        self.label = label
        self.enabled = enabled and sys.stderr.isatty()
        if self.enabled:
            _board.update(label, "waiting")

    def __call__(self, progress: pb.Progress) -> None:
        if not self.enabled:
            return
        stage = (
            pb.Progress.Stage.Name(progress.stage).lower()
            if progress.stage != pb.Progress.STAGE_UNSPECIFIED
            else "waiting"
        )
        _board.update(self.label, stage)

    def close(self) -> None:
        if self.enabled:
            _board.remove(self.label)
