"""debug_flags' stand-in for Inductor's debug module, in fresh processes (this one may have
imported the module already): a loaded graph's call reads the flags without importing it,
and the stand-in reads and writes as the module once anything imports it."""

import subprocess
import sys

_SETUP = """
import inspect, re, sys
import torch._inductor
from torch._inductor.output_code import CompiledFxGraph
from torchfarm.torch_adapter.load import debug_flags

DEBUG = "torch._inductor.debug"
assert DEBUG not in sys.modules
debug_flags.provide()
stand_in = torch._inductor.debug
"""

_READ_THEN_WRITTEN = """
call = inspect.getsource(CompiledFxGraph.__call__)
read = set(re.findall(r"torch\\._inductor\\.debug\\.(\\w+)", call))
assert read == set(debug_flags._DEFAULTS), read  # what a graph's call reads, every name
assert {name: getattr(stand_in, name) for name in read} == debug_flags._DEFAULTS
assert DEBUG not in sys.modules  # read without importing the module
stand_in.RECORD_GRAPH_EXECUTION = True  # a write goes to the module, imported then
real = sys.modules[DEBUG]
assert torch._inductor.debug is real and real.RECORD_GRAPH_EXECUTION is True
assert stand_in.RECORD_GRAPH_EXECUTION is True  # the module's own value from then on
assert stand_in.DebugContext is real.DebugContext
print("ok")
"""

_IMPORTED = """
from torch._inductor.debug import DebugContext  # any import of the module
import torch._inductor.debug as real

assert torch._inductor.debug is real and real is not stand_in
assert {name: getattr(real, name) for name in debug_flags._DEFAULTS} == debug_flags._DEFAULTS
debug_flags.provide()  # imported: nothing changes
assert torch._inductor.debug is real
print("ok")
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _SETUP + code], capture_output=True, text=True, timeout=300
    )


def test_a_graphs_call_reads_the_flags_unimported_and_a_write_reaches_the_module():
    done = _run(_READ_THEN_WRITTEN)
    assert done.stdout.strip() == "ok", done.stderr[-3000:]


def test_an_import_of_the_module_replaces_the_stand_in_and_its_defaults_are_the_modules():
    done = _run(_IMPORTED)
    assert done.stdout.strip() == "ok", done.stderr[-3000:]
