"""A one-line progress display on stderr for farm waits over ~2 s (TTY only)."""

from __future__ import annotations

import sys
import time

from torchfarm.proto import torchfarm_pb2 as pb

SHOW_AFTER_S = 2.0


class ProgressLine:
    def __init__(self, label: str, enabled: bool):
        self.label = label
        self.enabled = enabled and sys.stderr.isatty()
        self.started = time.monotonic()
        self.shown = False

    def __call__(self, progress: pb.Progress) -> None:
        elapsed = time.monotonic() - self.started
        if not self.enabled or elapsed < SHOW_AFTER_S:
            return
        stage = (
            pb.Progress.Stage.Name(progress.stage).lower()
            if progress.stage != pb.Progress.STAGE_UNSPECIFIED
            else "waiting"
        )
        sys.stderr.write(f"\r[torchfarm] {self.label}: {stage} {elapsed:5.1f} s ")
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
