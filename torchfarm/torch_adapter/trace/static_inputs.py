"""Tell AOTAutograd which inputs of a farm graph are static, as Dynamo's graph told it locally.

A Dynamo graph's parameters and buffers are inputs that Dynamo marks static; AOTAutograd reads
the marks from the graph (`_try_get_metadata_from_dynamo`: the placeholders' `tensor_dict`,
with the module's sources) into `static_input_indices`, and Inductor then assumes what it saw
of those inputs holds at every call. Above all their alignment: an input not known static is
checked at every call (`copy_misaligned_inputs`, one `data_ptr` per GPU input). The farm's
graph is rebuilt without Dynamo's sources, so AOTAutograd found no static input: every
parameter was checked at every step (a 4-layer GPT's training step on an H100, 1.5 ms and
host bound: 0.035 ms of the farm's extra host time under the profiler). The client marks them
in the payload (serialize.py), and `declared` gives AOTAutograd those positions where it finds
none of Dynamo's, as it does for an exported program's parameters.

Uses torch._functorch.aot_autograd's `_try_get_metadata_from_dynamo(mod, param_keys,
full_args_num, full_args_descs)`, returning (sources or None, static input indices), looked up
there at call time. Verified: torch 2.13.0 on the CPU (Inductor is given the parameters'
positions), 2.11.0+cu130 on an H100 (the farm's code no longer calls copy_misaligned_inputs);
where torch has no such function the graph compiles as before, no input static.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

from torch._functorch import aot_autograd


@contextlib.contextmanager
def declared(positions: list[int]) -> Iterator[None]:
    """While entered, a graph that is not Dynamo's own has its inputs at `positions` (after
    any parameters of the module itself) static."""
    original = getattr(aot_autograd, "_try_get_metadata_from_dynamo", None)
    if original is None or not positions:
        yield
        return

    def with_static(mod, param_keys, full_args_num, *args, **kwargs):
        sources, static = original(mod, param_keys, full_args_num, *args, **kwargs)
        if sources is None and not static:  # no Dynamo metadata: the farm's graph
            lifted = len(param_keys)
            static = [lifted + i for i in positions if lifted + i < full_args_num]
        return sources, static

    with mock.patch.object(aot_autograd, "_try_get_metadata_from_dynamo", with_static):
        yield
