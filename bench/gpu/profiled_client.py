"""client.py with the farm artifact's load under cProfile: where a hit's load_s goes.

profiled_client.py PROFILE_OUT MODEL MODE BACKEND OUTFILE   (the rest as client.py)

PROFILE_WHOLE=1 profiles the whole process instead (model built, eager reference step,
torch.compile and first step): where a warm start's time goes outside the load, for the
farm and for PyTorch's own caches alike. PROFILE_WHOLE=first profiles the main thread from
the compile call to the end of the first step, the window a warm start is timed over, and
logs the client's debug lines (the prewarm's steps, on its own threads) to stderr.
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import client  # noqa: E402

from torchfarm.client import graph  # noqa: E402

profiler = cProfile.Profile()
original = graph.load_code


@functools.wraps(original)
def profiled(*args, **kwargs):
    profiler.enable()
    try:
        return original(*args, **kwargs)
    finally:
        profiler.disable()


whole = os.environ.get("PROFILE_WHOLE") == "1"
if os.environ.get("PROFILE_WHOLE") == "first":
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("torchfarm.client").setLevel(logging.DEBUG)

    @contextlib.contextmanager
    def window():
        profiler.enable()
        try:
            yield
        finally:
            profiler.disable()

    client.first_step_window = window
elif not whole:
    graph.load_code = profiled
try:
    if whole:
        profiler.enable()
    client.main(*sys.argv[2:6])
finally:
    profiler.disable()
    profiler.dump_stats(sys.argv[1])
