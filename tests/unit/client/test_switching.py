"""No-wait mode's two parts without a farm: telling a hit from a compile by the farm's first
word, and a graph that runs eagerly until its code is ready, then switches between calls."""

import threading

import torch

from torchfarm.client.pool import Job, Pool
from torchfarm.client.switching import FarmAnswer, Pending, SwitchingGraph
from torchfarm.compiler import guards, serialize
from torchfarm.proto import torchfarm_pb2 as pb


def f(x, w):
    return torch.relu(x @ w) * 2


def _graph(dynamic: bool) -> torch.fx.GraphModule:
    """f's Dynamo graph; `dynamic`: the batch size (only) is a symbol, a graph input."""
    captured = {}

    def capture(gm, example_inputs):
        captured["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(4, 8)
    if dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    torch.compile(f, backend=capture)(x, torch.randn(8, 3))
    return captured["gm"]


def _answer_to(events: list[pb.Progress], then=lambda: "artifact") -> tuple[FarmAnswer, Job]:
    answer = FarmAnswer()

    def fetch():
        for event in events:
            answer.heard(event)
        return then()

    return answer, Pool(1).submit(fetch)


def test_a_download_is_a_hit_and_is_waited_for():
    downloading = pb.Progress(stage=pb.Progress.DOWNLOADING)
    answer, job = _answer_to([downloading])
    assert answer.serves(job, first_word_s=30)
    assert job.result() == "artifact"


def test_any_other_first_word_means_the_farm_compiles_and_is_not_waited_for():
    release = threading.Event()
    answer, job = _answer_to([pb.Progress(stage=pb.Progress.QUEUED)], then=release.wait)
    assert not answer.serves(job, first_word_s=30)
    assert not job.future.done()  # it went on compiling in the background
    release.set()


def test_a_fetch_waiting_for_a_pool_thread_is_not_waited_for():
    release = threading.Event()
    busy = Pool(1)
    busy.submit(release.wait)  # the one thread compiles another graph
    answer, queued = FarmAnswer(), busy.submit(lambda: "artifact")
    assert not answer.serves(queued, first_word_s=30)
    release.set()
    assert queued.future.result() == "artifact"


def test_silence_and_failure_are_not_hits():
    release = threading.Event()
    answer, job = _answer_to([], then=release.wait)
    assert not answer.serves(job, first_word_s=0.05)
    release.set()

    def fail():
        raise RuntimeError("farm down")

    answer, job = _answer_to([], then=fail)
    assert not answer.serves(job, first_word_s=30)


class _Farm:
    """The fetch job, finished on demand, and the code it resolves to (`pending`)."""

    def __init__(self, code, shape_guards=pb.ShapeGuards()):
        self.done = threading.Event()
        self.job = Pool(1).submit(self.done.wait)
        self.switch = code, shape_guards
        self.resolved: list[int] = []
        self.pending = Pending(self.job, self.resolve)

    def resolve(self, job, graph):
        assert job is self.job and job.future.done()
        self.resolved.append(graph.eager_calls)
        return self.switch[0] and self.switch

    def finish(self):
        self.done.set()
        self.job.future.result()


def test_eager_until_the_code_is_ready_then_the_code_from_the_next_call_on():
    gm = _graph(dynamic=False)
    compiled_calls = []

    def code(*args):
        compiled_calls.append(args)
        return gm.forward(*args)

    farm = _Farm(code)
    graph = SwitchingGraph(gm, serialize.example_inputs(gm), farm.pending, "graph t")
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    for _ in range(3):
        torch.testing.assert_close(graph(x, w)[0], f(x, w))
    assert graph.eager_calls == 3 and not compiled_calls and not farm.resolved
    farm.finish()
    for _ in range(2):
        torch.testing.assert_close(graph(x, w)[0], f(x, w))
    assert farm.resolved == [3]  # resolved once, at the first call after the job ended
    assert graph.eager_calls == 3 and len(compiled_calls) == 2


def test_a_failed_farm_leaves_the_graph_eager():
    gm = _graph(dynamic=False)
    farm = _Farm(None)
    graph = SwitchingGraph(gm, serialize.example_inputs(gm), farm.pending, "graph t")
    farm.finish()
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    for _ in range(3):
        torch.testing.assert_close(graph(x, w)[0], f(x, w))
    assert farm.resolved == [0] and graph.eager_calls == 3


def test_sizes_outside_the_codes_shape_guards_run_eagerly():
    gm = _graph(dynamic=True)
    inputs = serialize.example_inputs(gm)
    assert sum(isinstance(x, torch.SymInt) for x in inputs) == 1, inputs  # the batch
    compiled_calls = []

    def code(*args):
        compiled_calls.append(args)
        return gm.forward(*args)

    farm = _Farm(code, guards.parse("L['t0'] <= 6", 1))  # the code covers batches up to 6
    graph = SwitchingGraph(gm, inputs, farm.pending, "graph t")
    farm.finish()
    w = torch.randn(8, 3)
    for batch in (5, 9, 6, 9):
        x = torch.randn(batch, 8)
        tensors = [x, w]
        args = [batch if isinstance(a, torch.SymInt) else tensors.pop(0) for a in inputs]
        torch.testing.assert_close(graph(*args)[0], f(x, w))
    assert len(compiled_calls) == 2 and graph.eager_calls == 2


def test_wait_is_on_unless_turned_off_by_the_environment_or_the_call(monkeypatch):
    from torchfarm.settings import ClientSettings

    monkeypatch.delenv("TORCHFARM_WAIT", raising=False)
    assert ClientSettings.from_env().wait
    assert not ClientSettings.from_env(wait=False).wait
    monkeypatch.setenv("TORCHFARM_WAIT", "0")
    assert not ClientSettings.from_env().wait
    assert ClientSettings.from_env(wait=True).wait  # torchfarm.compile(wait=True) wins


def test_work_for_the_switch_starts_at_the_second_call_not_in_the_first():
    # The load's prewarm (backend.py) would slow the first step's tracing: it starts after it.
    gm = _graph(dynamic=False)
    farm = _Farm(None)
    started: list[int] = []
    graph = SwitchingGraph(
        gm,
        serialize.example_inputs(gm),
        farm.pending,
        "graph t",
        after_first_call=lambda: started.append(graph.eager_calls),
    )
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    graph(x, w)
    assert started == []
    graph(x, w)
    graph(x, w)
    assert started == [1]  # once, before the second call ran
    farm.finish()
