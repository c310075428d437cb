"""Python's cyclic garbage collector held off while the client imports and restores.

What a farm hit does in `torchfarm.compile` is mostly importing (Dynamo, AOTAutograd's
runtime, the client's own modules: some 1,500 modules on a CPU skip hit) and unpickling:
objects made to live as long as the process. Every object made counts towards the
collector's next pass, and as the heap grows by a quarter the pass takes the oldest
generation: every object of the process, torch's own included, walked again, freeing
nearly nothing. On the CPU box (torch 2.13, a skip hit of bench/skip_tracing.py's model)
those passes took 0.45 s of 1.8 s. `paused` turns the collector off for its block, where it
was on, and on again after: what the block left is then collected in the collector's next
passes, as for anything else the program made.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection in the block (a no-op where the collector is off already)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
