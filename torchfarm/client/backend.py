"""The Dynamo backend `torchfarm`: every graph Dynamo captures goes through the farm.

Registered through the `torch_dynamo_backends` entry point, so `torch.compile(m,
backend="torchfarm")` needs no import. A farm that is unset, down, slow or failing never
breaks the job: the graph is compiled locally (then run eagerly), with one warning. Where the
local compile fails with one of the fake-tensor errors on which Dynamo splits a graph (an op
whose output depends on data), the error goes to Dynamo, which then splits the graph around
that op exactly as it does for local torch.compile.

This module builds each graph's FarmGraph (client/graph.py) and picks its route; the routes
live in deferred.py, switching.py (no-wait) and prepare.py.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable

import torch

from torchfarm import torch_adapter
from torchfarm.client import prepare, remote, switching
from torchfarm.client.deferred import DeferredGraph
from torchfarm.client.graph import FarmGraph, request_observers
from torchfarm.client.pool import Job
from torchfarm.client.records import GraphRecord, history, warn_once
from torchfarm.compiler import trace_state
from torchfarm.compiler.target import local_target
from torchfarm.contract import modes
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings
from torchfarm.torch_adapter.load import load_prewarm
from torchfarm.torch_adapter.trace.deferrable import deferrable

# The client's public names: every graph's record, and the hook on its farm request.
__all__ = ["GraphRecord", "history", "request_observers", "torchfarm_backend"]
log = logging.getLogger("torchfarm")
_graph_numbers = itertools.count(1)
_started = False


def torchfarm_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    mode: str | None = None,
    options: dict | None = None,
    **farm: str | bool | None,
) -> Callable:
    """Compile one Dynamo graph on the farm; `options` are Inductor config patches, `farm`
    the settings torchfarm.compile overrides (addr, token, wait).

    A static graph of torch's own operators (torch_adapter/trace/deferrable.py: nothing to install
    into Dynamo's ShapeEnv, no split to hand to Dynamo) is fetched in the background and the
    call returns at once, so that the graphs Dynamo hands over before running any
    (DDPOptimizer's buckets) compile in parallel; its first call waits for it. Any other
    graph blocks here, as before. With `wait` False (TORCHFARM_WAIT=0) a graph that the farm
    does not serve at once runs eagerly until its code arrives (client/switching.py)."""
    graph = FarmGraph(
        gm,
        example_inputs,
        ClientSettings.from_env(**farm),
        pb.Options(
            mode=modes.named(mode),
            config_patches_json=json.dumps(options, sort_keys=True) if options else "",
            state=trace_state.capture(),
        ),
        f"graph {next(_graph_numbers)}",
    )
    if not graph.settings.addr:
        warn_once("TORCHFARM_ADDR is not set: compiling locally")
        return graph.compile_locally()
    if torch_adapter.UNVERIFIED:  # never drift silently: the farm's torch code may not fit
        warn_once(f"{torch_adapter.UNVERIFIED}; compiling locally")
        return graph.compile_locally(why=torch_adapter.UNVERIFIED)
    prepared_for = prepare.target()
    if prepared_for is not None:
        return prepare.prepare_graph(graph, prepared_for)
    start(graph.settings)
    return _from_the_farm(graph)


def start(settings: ClientSettings) -> None:
    """The process's one-time work for loading the farm's code, as early as the backend is
    chosen (client/entry.py, the decorator; else at the first graph bound for the farm), so
    that it overlaps Dynamo's trace: the first load's imports and prewarm (in no-wait mode
    its thread from the second step: client/switching.py), and the connection to the farm
    with its keys and the target's probes. Not without a farm address, nor while `torchfarm
    prepare` runs the program (its fake tensors are no place for the load's imports)."""
    global _started
    if not _started and settings.addr and prepare.target() is None:
        _started = True
        load_prewarm.start(defer=not settings.wait)
        remote.connect_early(settings, local_target)


def _from_the_farm(graph: FarmGraph) -> Callable:
    """The graph's code from the farm (or compiled here, or eager)."""
    try:
        question = graph.ask()
        if not graph.settings.wait:
            question.request.label = f"{graph.label} (eager while compiling)"  # progress line
            answer = switching.FarmAnswer()
            job = graph.submit(question, answer.heard)
            if not answer.serves(job):
                return switching.eager_while_compiling(graph, job)
            fetched = job.result()  # a hit: served as in wait mode
        elif graph.settings.parallel_graphs and deferrable(graph.gm):
            log.debug("%s: submitted", graph.label)
            return DeferredGraph(graph, graph.submit(question))
        else:
            fetched = graph.fetch(question)
        graph.install_guards(fetched)
        compiled = graph.load(fetched)
    except Exception as e:  # the farm must never break training
        if not graph.settings.wait:  # nor make it wait: handled at the first call, as failed
            failed: Job = Job(lambda: None)
            failed.future.set_exception(e)
            return switching.eager_while_compiling(graph, failed)
        return graph.compile_locally(why=graph.farm_failed(e))
    graph.record_served(fetched)
    return compiled
