"""Compile a training graph's backward in a second process while this one compiles its forward.

AOTAutograd partitions the joint graph, then compiles the forward and only after it the
backward (`_aot_stage2b_fw_compile`, then `_aot_stage2b_bw_compile`), in one process; on the
GPU each is about half of Inductor's time (bench/compile_phases.py). A compile child therefore
has a helper: a second process of the same sandbox, given the same request, that traces and
partitions the same graph and then, under `backward_only`, skips the forward (a stub) and
compiles the backward with Inductor's FX graph cache on, so that its compiled backward lands
in the cache dir the two processes share; then it stops. The child itself, under
`backward_from`, waits for the helper just before its own backward and compiles it with the
FX graph cache on: the same graph, inputs and config give the same key, so the backward is
a cache hit (Triton bundle and guards included) and costs a load, not a compile.

Nothing depends on the helper for correctness: where it failed, or where the child's key
differs (the forward's compile chose other strides for the saved activations, which the
helper cannot know), the lookup misses and the child compiles its backward itself.

The FX graph cache is off under AOTAutograd's bundled cache (`bundled_autograd_cache`, which
the worker's compile uses): it is turned off around the backward's compile only, in both
processes, and AOTAutograd bundles the looked-up backward like a compiled one. On a GPU a
looked-up graph keeps its Triton bundle, whose statically launchable autotuners Inductor's
lookup (`TritonBundler.read_and_emit`) hands on to the kernels it loads: loaded, they can
no longer be pickled, and the bundled entry pickles that bundle. The lookup here is given a
copy, so that the bundle the graph keeps stays as it was stored.

Uses torch._functorch._aot_autograd.graph_compile's `_aot_stage2b_compile_forward_or_inference`
(its `is_inference` keyword) and `_aot_stage2b_bw_compile`, looked up there at call time,
functorch's `bundled_autograd_cache` config, and the static `TritonBundler.read_and_emit`.
Verified: torch 2.11.0, 2.13.0, 2.15.0 on the CPU (a helper process and the child on one
payload: the child's backward a lookup, `fxgraph_cache_hit` 1) and 2.11.0+cu130 on the H200
(bench/gpu/run.sh novel: every helped compile's backward the helper's).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator
from unittest import mock

from torch._dynamo.utils import counters
from torch._functorch import config as functorch_config
from torch._functorch._aot_autograd import graph_compile
from torch._inductor.triton_bundler import TritonBundler


class Stopped(BaseException):
    """The helper's work is over: a BaseException, so that no `except Exception` of torch's
    on the way up turns it into a compile error."""


def _forward_stub(*args, **kwargs):
    raise RuntimeError("the helper's forward is a stub: it never runs")


@contextlib.contextmanager
def backward_only() -> Iterator[None]:
    """The helper's compile: no forward, the backward into the FX graph cache, then Stopped
    (an inference graph stops at once)."""
    compile_backward = graph_compile._aot_stage2b_bw_compile

    def forward(*args, is_inference: bool, **kwargs):
        if is_inference:
            raise Stopped("no backward to compile")
        return None, _forward_stub  # no output strides: the backward's inputs as traced

    def backward(*args, **kwargs):
        with functorch_config.patch(bundled_autograd_cache=False):
            compile_backward(*args, **kwargs)
        raise Stopped("backward compiled")

    with (
        mock.patch.object(graph_compile, "_aot_stage2b_compile_forward_or_inference", forward),
        mock.patch.object(graph_compile, "_aot_stage2b_bw_compile", backward),
    ):
        yield


@dataclasses.dataclass
class Backward:
    """What became of the graph's backward: compiled by the "helper" (looked up), by the
    "child" itself (the lookup missed), or "" (the graph has none)."""

    compiled_by: str = ""


@contextlib.contextmanager
def backward_from(wait_for_helper: Callable[[], object]) -> Iterator[Backward]:
    """The child's compile: before the backward, `wait_for_helper()`; then the backward with
    the FX graph cache on, which finds the helper's entry when the keys agree."""
    compile_backward = graph_compile._aot_stage2b_bw_compile
    emit = TritonBundler.read_and_emit
    outcome = Backward()

    def backward(*args, **kwargs):
        wait_for_helper()
        hits = counters["inductor"]["fxgraph_cache_hit"]
        with (
            functorch_config.patch(bundled_autograd_cache=False),
            mock.patch.object(
                TritonBundler, "read_and_emit", staticmethod(lambda b: emit(copy.deepcopy(b)))
            ),
        ):
            lazy_info, compiled = compile_backward(*args, **kwargs)
        helped = counters["inductor"]["fxgraph_cache_hit"] > hits
        outcome.compiled_by = "helper" if helped else "child"
        # A looked-up graph remembers its key and the key's inputs (tens of KB of text):
        # dropped, so that the bundled entry holds what a compile here would have made.
        graph = compiled
        while graph is not None:
            for name in ("_fx_graph_cache_key", "_fx_graph_cache_debug_lines"):
                if getattr(graph, name, None) is not None:
                    setattr(graph, name, None)
            graph = getattr(graph, "__wrapped__", None)
        return lazy_info, compiled

    with mock.patch.object(graph_compile, "_aot_stage2b_bw_compile", backward):
        yield outcome
