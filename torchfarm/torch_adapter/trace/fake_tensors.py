"""Fake tensors and the tracing context a compile runs in.

Uses torch._subclasses.FakeTensor / FakeTensorMode, torch._guards.detect_fake_mode,
TracingContext and tracing. Verified: torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch._guards
from torch._subclasses import FakeTensor, FakeTensorMode

__all__ = ["FakeTensor", "FakeTensorMode", "detect_fake_mode", "tracing"]

detect_fake_mode = torch._guards.detect_fake_mode


@contextlib.contextmanager
def tracing(fake_mode: FakeTensorMode) -> Iterator[None]:
    """Run the block in a tracing context over `fake_mode`, as Dynamo calls a backend."""
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
        yield
