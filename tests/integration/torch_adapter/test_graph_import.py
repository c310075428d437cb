"""graph_import's stand-in for Inductor's graph module, in a fresh process (this one may
have imported the real module already): it serves the one import that follows a loaded
output code, on the loading thread, and any other use gets the real module (an artifact's
load without it: tests/integration/test_load.py)."""

import subprocess
import sys

# In a fresh process: this one may have imported Inductor's graph module already.
_STAND_IN = """
import sys, threading
from torch._inductor.output_code import CompiledFxGraph
from torchfarm.torch_adapter.load import graph_import

GRAPH = "torch._inductor.graph"
assert GRAPH not in sys.modules
taken = {}
with graph_import.left_out():
    sys.modules[GRAPH] = graph_import._StandIn()  # as after a loaded output code
    from torch._inductor.graph import GraphLowering  # cache_hit_post_compile's import
    taken["load"], taken["left"] = GraphLowering, GRAPH in sys.modules
    sys.modules[GRAPH] = stand_in = graph_import._StandIn()
    other = threading.Thread(target=lambda: taken.update(other=stand_in.GraphLowering))
    other.start()
    other.join()
import torch._inductor.graph as real

assert taken["load"].save_output_code is None and taken["load"] is not real.GraphLowering
assert not taken["left"]  # taken by the one import: gone from sys.modules
assert taken["other"] is real.GraphLowering  # another thread imported the real module
assert CompiledFxGraph.after_deserialization.__module__ == "torch._inductor.output_code"
print("ok")
"""


def test_the_stand_in_serves_one_import_on_the_loading_thread_and_the_real_one_else():
    done = subprocess.run(
        [sys.executable, "-c", _STAND_IN], capture_output=True, text=True, timeout=300
    )
    assert done.stdout.strip() == "ok", done.stderr[-3000:]
