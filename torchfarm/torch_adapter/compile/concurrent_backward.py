"""Compile a training graph's backward in a second process while this one compiles its forward.

AOTAutograd partitions the joint graph, then compiles the forward and only after it the
backward (`_aot_stage2b_fw_compile`, then `_aot_stage2b_bw_compile`), in one process; on the
GPU each is about half of Inductor's time (bench/compile_phases.py). A compile child therefore
has a helper: a second process of the same sandbox, given the same request, that traces and
partitions the same graph and then, under `backward_only`, skips the forward (a stub) and
compiles the backward with Inductor's FX graph cache on, so that its compiled backward lands
in the cache dir the two processes share; then it stops. The child itself, under
`backward_from`, compiles its own backward with the FX graph cache on: the same graph, inputs
and config give the same key, so the backward is a cache hit (Triton bundle and guards
included) and costs a load, not a compile.

The two meet at their backward's key (`FxGraphCache.prepare_key`, which `_compile_fx_inner`
calls before its lookup and compile): the helper hands its key on as soon as Inductor computed
it, before it compiles, and the child, at its own key, waits only for the helper's key
(`meet`). Equal, it then waits for the helper's end and looks its backward up; different,
it does not wait for a compile it cannot use: it ends the helper (its cores are freed) and
compiles the backward itself. Waiting for the helper's whole compile before such a miss made
convnext's miss 1.39× a local cold compile against 1.13× without the helper
(docs/benchmarks.md, "Novel misses"). A helper whose backward bypasses the cache stops at its
key, which it never hands on.

The backward's key holds its inputs' strides, and AOTAutograd gives the saved activations
the strides the forward's compile chose for them (`_aot_stage2b_bw_compile` restrides the
backward's placeholders to the forward's output strides), which may not be the traced ones:
Inductor's layout optimization (a graph with fewer than 300 nodes per convolution, or any on
a CPU with oneDNN) stores the 4-D activations around a convolution channels-last, and
comprehensive padding (GPU) pads a saved activation's strides. So the child sends the helper
the forward's output strides as soon as its lowering has decided them (`GraphLowering.run`
ended; Inductor reads them there too). The helper does not wait for them: it lowers its
backward at once for the traced strides (its forward stub returns none), and reads the
child's at the end of that lowering, or at its next node once they have arrived; where
AOTAutograd would restride a placeholder with them (`_restrides`), it cuts that lowering
there and lowers the backward again for them (`_Restrided`), and only then hands its key on.
A transformer's saved activations keep their traced strides, so its backward's lowering
overlaps the child's forward lowering instead of following it; a CNN's helper wasted its
whole first lowering before it was cut at the strides' arrival (convnext's child waited
11-15 s for its helper on 2× H200, a transformer's 0.5-3.8 s).

Inductor benchmarks one joint-graph decision, pad_mm's (whether padding a matmul's operands
makes it faster), and two processes benchmarking side by side can decide otherwise: the
helper's llama backward held a `constant_pad_nd` where the child's held a `bmm`, keys apart
(bench/gpu/results/2026-11-30-h200x2-ddp-helper-auto). The helper therefore takes the child's
decisions from the cache dir they share (`_childs_pad_decisions`).

Nothing depends on the helper for correctness: where it failed, or where the child's key
differs all the same, the lookup misses and the child compiles its backward itself. The
two processes then each hold their backward's key and the details Inductor hashed into it
(`Key`), and `difference` says in a line which of those details differ.

Under CUDA graphs (reduce-overhead, max-autotune) the backward's key holds fx_kwargs boxes
that the child's forward compile sets: `cudagraphs` (turned off where the forward cannot be
recorded, a CPU graph among others) and, where it stays on, the forward's device index. The
helper compiles no forward, so it sets them as the forward would for a graph on one GPU (on,
that GPU's index) and turns `cudagraphs` off for a graph on none (`_as_after_forward`); where
the forward decided otherwise, the keys differ at the meeting and the child compiles its
backward itself, as without a helper: a forward CUDA graphs cannot record (it turns them off),
and from torch 2.12 a forward split into CUDA-graph partitions around ops they cannot record
(`forward_is_partitioned`, 2.15's `forward_is_cudagraph_partitioned`: the backward's static
inputs, in its key, are then fewer), which the helper takes as unsplit.

The FX graph cache is off under AOTAutograd's bundled cache (`bundled_autograd_cache`, which
the worker's compile uses): it is turned off around the backward's compile only, in both
processes, and AOTAutograd bundles the looked-up backward like a compiled one. On a GPU a
looked-up graph keeps its Triton bundle, whose statically launchable autotuners Inductor's
lookup (`TritonBundler.read_and_emit`) hands on to the kernels it loads: loaded, they can
no longer be pickled, and the bundled entry pickles that bundle. The lookup here is given a
copy, so that the bundle the graph keeps stays as it was stored.

Uses torch._functorch._aot_autograd.graph_compile's `_aot_stage2b_compile_forward_or_inference`
(its `is_inference` keyword, its output strides) and `_aot_stage2b_bw_compile` (its first six
arguments positional), looked up there at call time, with `_get_inner_meta` and
`fx_placeholder_vals` (the restride test), pad_mm's module-level `get_cached_should_pad`
(a LocalCache file in the cache dir), `GraphLowering.run` and its `graph_outputs`' layouts,
`GraphLowering.run_node` (called per node of the graph lowered), the module-level
`compile_fx.compile_fx_backward` (which `compile_fx`'s backward compiler looks up at call
time) with its `CompilerConfigExtra`'s `cudagraphs` (a `BoxedBool`) and `forward_device`
(2.15: `forward_device_index`, a `BoxedDeviceIndex`), functorch's `bundled_autograd_cache`
config, the static `TritonBundler.read_and_emit`, and the static `FxGraphCache.prepare_key`
(returns `(key, debug_lines)` or None, and cache info), which
`_compile_fx_inner` looks up on the class at call time, right before `load_with_key` (read in
torch 2.11.0, 2.13.0, 2.14.1 and 2.15.0).
Verified: torch 2.11.0, 2.13.0, 2.15.0 on the CPU (a helper process and the child on one
payload: the child's backward a lookup, `fxgraph_cache_hit` 1; with the forward's strides
sent, also a CNN whose saved activations the forward stores channels-last, and the zoo's ViT
at its GPU size; under reduce-overhead, the `cudagraphs` box turned off) and 2.11.0+cu130 on
the H200 (bench/gpu/run.sh novel: every helped compile's backward the helper's, in the
default mode and, the device index set, under max-autotune with CUDA graphs).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import sympy
import torch
from torch._dynamo.utils import counters
from torch._functorch import config as functorch_config
from torch._functorch._aot_autograd import graph_compile
from torch._inductor import compile_fx
from torch._inductor.codecache import FxGraphCache
from torch._inductor.fx_passes import pad_mm
from torch._inductor.graph import GraphLowering
from torch._inductor.ir import IRNode
from torch._inductor.triton_bundler import TritonBundler
from torch._inductor.utils import BoxedBool

# The forward's output strides, as AOTAutograd restrides the backward's inputs with them:
# None for an output that is not a tensor or whose strides are symbolic (never restrided).
Strides = list[tuple[int, ...] | None]


class Stopped(BaseException):
    """The helper's work is over: a BaseException, so that no `except Exception` of torch's
    on the way up turns it into a compile error."""


def _forward_stub(*args, **kwargs):
    raise RuntimeError("the helper's forward is a stub: it never runs")


def _static(strides: Sequence[Any] | None) -> tuple[int, ...] | None:
    if strides is None or not all(isinstance(s, (int, sympy.Integer)) for s in strides):
        return None
    return tuple(int(s) for s in strides)


@dataclasses.dataclass
class Key:
    """A backward's FX graph cache key and the details Inductor hashed into it: its debug
    lines, each `[hash] name: value` (tens of KB)."""

    key: str
    lines: list[str]


@dataclasses.dataclass
class Backward:
    """What became of the graph's backward: compiled by the "helper" (looked up), by the
    "child" itself (the lookup missed), or "" (the graph has none); and the child's key where
    its lookup missed (None: none computed, a bypass)."""

    compiled_by: str = ""
    key: Key | None = None
    # time.monotonic() at the child's backward key; then seconds waited there for the
    # helper, and seconds to look its backward up and load it
    key_at: float = 0.0
    wait_s: float = 0.0
    load_s: float = 0.0


@dataclasses.dataclass
class HelperTimes:
    """When the helper's backward went where (time.monotonic(), which the child's process on
    the same host shares; 0: not reached): its compile began (its trace and partition done),
    its last lowering ended, its compile ended (the backward stored in the cache dir)."""

    began: float = 0.0
    lowered: float = 0.0
    compiled: float = 0.0


def _graphs(compiled: Any) -> Iterator[Any]:
    """The compiled backward and what it wraps, down to Inductor's compiled graph."""
    while compiled is not None:
        yield compiled
        compiled = getattr(compiled, "__wrapped__", None)


@contextlib.contextmanager
def _keyed(on_key: Callable[[Key | None], None]) -> Iterator[None]:
    """While entered, the first graph's FX graph cache key (None: the graph bypasses the
    cache) goes to `on_key` as soon as Inductor computed it, before its lookup and compile."""
    prepare = FxGraphCache.prepare_key
    told = False

    def prepare_key(*args: Any, **kwargs: Any) -> Any:
        nonlocal told
        key_info, cache_info = prepare(*args, **kwargs)
        if not told:
            told = True
            on_key(None if key_info is None else Key(key_info[0], list(key_info[1])))
        return key_info, cache_info

    with mock.patch.object(FxGraphCache, "prepare_key", staticmethod(prepare_key)):
        yield


@contextlib.contextmanager
def _as_after_forward() -> Iterator[None]:
    """While entered, Inductor's backward compile finds the boxes the forward's compile shares
    with it (`CompilerConfigExtra`) set as a forward on the backward's device sets them under
    CUDA graphs (`prepare_cudagraph_post_compile`: the forward's device index; a forward on
    no GPU turns `cudagraphs` off); without CUDA graphs nothing is set."""
    compile_fx_backward = compile_fx.compile_fx_backward

    def backward(gm: Any, example_inputs: Sequence[Any], compiler_config_extra: Any, **kwargs):
        extra = compiler_config_extra
        if extra.cudagraphs:
            gpus = {
                t.device.index or 0
                for t in example_inputs
                if isinstance(t, torch.Tensor) and t.device.type == "cuda"
            }
            if len(gpus) == 1:
                device = getattr(extra, "forward_device", None)  # torch 2.11-2.14
                device = device or extra.forward_device_index  # 2.15
                device.set(gpus.pop())
            else:
                BoxedBool.disable(extra.cudagraphs)
        return compile_fx_backward(gm, example_inputs, compiler_config_extra, **kwargs)

    with mock.patch.object(compile_fx, "compile_fx_backward", backward):
        yield


_DETAIL = re.compile(r"\[(\w+)\] (.*?): (.*)", re.DOTALL)


def _details(lines: list[str]) -> dict[str, tuple[str, str]]:
    """name -> (hash, value) of each debug line."""
    details = {}
    for line in lines:
        match = _DETAIL.fullmatch(line)
        name, digest, value = (match[2], match[1], match[3]) if match else (line, line, line)
        details[name] = (digest, value)
    return details


def _where(helper: str, child: str, width: int = 80) -> str:
    """The two values around their first difference (of a multi-line value, its first
    differing line)."""
    pairs = itertools.zip_longest(helper.splitlines(), child.splitlines(), fillvalue="")
    a, b = next(((x, y) for x, y in pairs if x != y), (helper, child))
    start = max(0, len(_common_prefix(a, b)) - width // 2)
    return f"helper {a[start : start + width]!r}, child {b[start : start + width]!r}"


def _common_prefix(a: str, b: str) -> str:
    return a[: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))]


def difference(helper: Key | None, child: Key | None, names: int = 6) -> str:
    """Why the child's lookup of the helper's backward missed, in one line: the names of the
    key's details that differ (the first `names`) and the first one's two values."""
    if helper is None:
        return "the helper left no key: its backward failed or bypassed the FX graph cache"
    if child is None:
        return "the child's backward bypassed the FX graph cache"
    if helper.key == child.key:
        return "the keys are equal: the helper's entry was not stored, or did not load"
    theirs, ours = _details(helper.lines), _details(child.lines)
    differ = [n for n in {**theirs, **ours} if theirs.get(n, ("",))[0] != ours.get(n, ("",))[0]]
    if not differ:
        return f"the keys differ ({helper.key[:12]}, {child.key[:12]}), their details do not"
    first = differ[0]
    shown = ", ".join(differ[:names])
    if len(differ) > names:
        shown += f" and {len(differ) - names} more"
    return f"{len(differ)} of the key's details differ: {shown}; {first}: " + _where(
        theirs.get(first, ("", "(none)"))[1], ours.get(first, ("", "(none)"))[1]
    )


class _Restrided(BaseException):
    """The child's forward stores a saved activation with other strides than the traced ones
    that the helper's backward was lowered for: compile it again, with the child's."""


def _restrides(args: Sequence[Any], strides: Strides) -> bool:
    """Whether AOTAutograd, given the forward's output `strides`, restrides a placeholder of
    the backward whose `_aot_stage2b_bw_compile` arguments are `args` (its own test, where a
    symbolic stride counts as different)."""
    bw_module, subclass_meta, fw_metadata, _, symints = args[:5]
    inner = graph_compile._get_inner_meta(subclass_meta, fw_metadata)
    saved = strides[inner.tensors_saved_for_backwards_slice]
    for i, placeholder in enumerate(graph_compile.fx_placeholder_vals(bw_module)):
        j = i - symints
        real = saved[j] if 0 <= j < len(saved) else None
        if isinstance(placeholder, torch.Tensor) and real is not None:
            if _static(placeholder.stride()) != tuple(real):
                return True
    return False


@contextlib.contextmanager
def _childs_pad_decisions(wait_s: float) -> Iterator[None]:
    """The helper's pad_mm decisions are the child's: a decision Inductor benchmarks (whether
    padding a matmul's operands makes it faster), taken by both processes side by side, could
    come out otherwise in each and key their backwards apart (seen on llama: `constant_pad_nd`
    in the helper's graph, `bmm` in the child's). The helper waits for the decision the child
    leaves in the cache dir they share: the helper gets its request from the child, so it is
    behind and mostly finds it there; `wait_s` at most (a key that differs: the user's TF32
    setting is part of it), then it benchmarks itself."""
    lookup = pad_mm.get_cached_should_pad

    def childs(key: str) -> Any:
        deadline = time.monotonic() + wait_s
        while (decided := lookup(key)) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return decided

    with mock.patch.object(pad_mm, "get_cached_should_pad", childs):
        yield


@contextlib.contextmanager
def backward_only(
    forward_strides: Callable[[], Strides | None],
    hand_on: Callable[[Key], None],
    pad_wait_s: float = 10.0,
    strides_arrived: Callable[[], bool] = lambda: False,
) -> Iterator[HelperTimes]:
    """The helper's compile: no forward; the backward lowered at once for the traced strides,
    then checked against the child's (`forward_strides()`: None where the child sent none)
    and lowered again for those where AOTAutograd restrides with them; its key to `hand_on`
    once it holds for the child's strides, before its code is generated and its kernels
    compiled; the backward into the FX graph cache, then Stopped (an inference graph, or a
    backward that bypasses the cache, stops at once). The check comes at the end of that
    first lowering, or at its next node once `strides_arrived()`: a lowering that restrides
    (a CNN's) is cut there, not run to its end for nothing. What is yielded says when the
    backward's compile began, its last lowering ended and its compile ended."""
    compile_backward = graph_compile._aot_stage2b_bw_compile
    run_node = GraphLowering.run_node
    times = HelperTimes()

    def forward(*args, is_inference: bool, **kwargs):
        if is_inference:
            raise Stopped("no backward to compile")
        return None, _forward_stub  # the traced strides: checked at the backward's lowering

    def backward(*args, **kwargs):
        times.began = time.monotonic()
        held: list[Key] = []
        checked: list[Strides] = []

        def keyed(key: Key | None) -> None:
            if key is None:
                raise Stopped("the backward bypasses the FX graph cache: no key to hand on")
            if checked:
                hand_on(key)
            else:  # handed on once it holds for the child's strides
                held.append(key)

        def check(_: Strides) -> None:
            if checked:
                return
            strides = forward_strides()
            if strides is None:
                raise Stopped("no forward strides: the child has gone")
            checked.append(strides)
            if _restrides(args, strides):
                raise _Restrided
            if held:
                hand_on(held[0])

        def early(self: GraphLowering, node: Any) -> Any:
            if not checked and strides_arrived():
                check([])
            return run_node(self, node)

        def lowered(strides: Strides) -> None:
            times.lowered = time.monotonic()
            check(strides)  # once checked, a no-op

        def compiled(strides: Strides | None) -> None:
            given = (*args[:3], strides, *args[4:])
            with (
                functorch_config.patch(bundled_autograd_cache=False),
                _keyed(keyed),
                _lowered(lowered),
                mock.patch.object(GraphLowering, "run_node", early),
            ):
                compile_backward(*given, **kwargs)
            times.compiled = time.monotonic()

        try:
            compiled(None)  # the traced strides
            check([])  # no lowering ran: checked now
        except _Restrided:
            compiled(checked[0])
        raise Stopped("backward compiled")

    with (
        mock.patch.object(graph_compile, "_aot_stage2b_compile_forward_or_inference", forward),
        mock.patch.object(graph_compile, "_aot_stage2b_bw_compile", backward),
        _childs_pad_decisions(pad_wait_s),
        _as_after_forward(),
    ):
        yield times


@contextlib.contextmanager
def _lowered(send: Callable[[Strides], None]) -> Iterator[None]:
    """While entered, the first graph lowered (its outermost `GraphLowering.run`: a subgraph's
    ends inside it) has its output strides `send`, as Inductor reports them to AOTAutograd."""
    run = GraphLowering.run
    depth = 0

    def lowered(self: GraphLowering, *args: Any) -> Any:
        nonlocal depth
        depth += 1
        try:
            result = run(self, *args)
        finally:
            depth -= 1
        if depth == 0:
            outputs = self.graph_outputs or []
            send(
                [
                    _static(out.get_layout().stride)
                    if isinstance(out, IRNode) and out.has_tensor_output()
                    else None
                    for out in outputs
                ]
            )
        return result

    with mock.patch.object(GraphLowering, "run", lowered):
        yield


@contextlib.contextmanager
def backward_from(
    meet: Callable[[Key | None], object], send_strides: Callable[[Strides], None]
) -> Iterator[Backward]:
    """The child's compile: the forward's output strides to `send_strides` once, as soon as its
    lowering decided them (at its end where no lowering ran); then the backward with the FX
    graph cache on, its key (None: a bypass) to `meet` before its lookup (which waits for the
    helper where the helper's key is the same, and ends it where not), a lookup that finds the
    helper's entry when the keys agree (where it did not, its key is in what is yielded)."""
    compile_forward = graph_compile._aot_stage2b_compile_forward_or_inference
    compile_backward = graph_compile._aot_stage2b_bw_compile
    emit = TritonBundler.read_and_emit
    outcome = Backward()
    sent = False

    def send_once(strides: Strides) -> None:
        nonlocal sent
        if not sent:
            sent = True
            send_strides(strides)

    def forward(*args, is_inference: bool, **kwargs):
        if is_inference:
            return compile_forward(*args, is_inference=is_inference, **kwargs)
        with _lowered(send_once):
            strides, compiled = compile_forward(*args, is_inference=is_inference, **kwargs)
        send_once([_static(s) for s in strides or []])
        return strides, compiled

    def keyed(key: Key | None) -> None:
        outcome.key = key
        outcome.key_at = time.monotonic()
        meet(key)
        outcome.wait_s = time.monotonic() - outcome.key_at

    def backward(*args, **kwargs):
        hits = counters["inductor"]["fxgraph_cache_hit"]
        with (
            functorch_config.patch(bundled_autograd_cache=False),
            _keyed(keyed),
            mock.patch.object(
                TritonBundler, "read_and_emit", staticmethod(lambda b: emit(copy.deepcopy(b)))
            ),
        ):
            lazy_info, compiled = compile_backward(*args, **kwargs)
        if outcome.key_at:
            outcome.load_s = time.monotonic() - outcome.key_at - outcome.wait_s
        helped = counters["inductor"]["fxgraph_cache_hit"] > hits
        outcome.compiled_by = "helper" if helped else "child"
        if helped:  # the child's key is kept only to compare with the helper's
            outcome.key = None
        # A compiled graph remembers its key and the key's details (tens of KB of text):
        # dropped, so that the bundled entry holds what a compile here would have made.
        for graph in _graphs(compiled):
            for name in ("_fx_graph_cache_key", "_fx_graph_cache_debug_lines"):
                if getattr(graph, name, None) is not None:
                    setattr(graph, name, None)
        return lazy_info, compiled

    with (
        mock.patch.object(graph_compile, "_aot_stage2b_compile_forward_or_inference", forward),
        mock.patch.object(graph_compile, "_aot_stage2b_bw_compile", backward),
    ):
        yield outcome
