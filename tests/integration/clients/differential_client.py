"""The skip's differential suite, one fresh process: compiled through the farm with the skip on
(the default), each result against eager. Prints a JSON line.

Usage:
  differential_client.py states         every kind of guarded state: a first call, then the
                                        state changed, each compared with eager
  differential_client.py model NAME     one training step of a model (bench's blocks or a
                                        coverage-suite architecture): outputs and gradients
                                        against eager, and their exact sums (to compare
                                        processes: a restored hit against a fresh compile)

Per case: frames traced (Dynamo's unique graphs) by the first call and by the changed call,
the largest error against eager, and whether dtype, shape and requires_grad all matched.
Device is not a case: this machine has one (CPU).
"""

import functools
import json
import logging
import os
import sys
import types

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import torchfarm  # noqa: E402
from torchfarm.client.backend import history  # noqa: E402
from torchfarm.compiler import serialize  # noqa: E402

# ---- what the cases guard ----------------------------------------------------------------


def helper(x):
    return torch.relu(x)


def helper_changed(x):
    return torch.tanh(x)


def rebound_global(x):
    return helper(x) * 2


ops = types.ModuleType("differential_ops")  # a module whose attribute is rebound
ops.act = torch.sigmoid
sys.modules[ops.__name__] = ops


def module_attribute(x):
    return ops.act(x) + 1


def scaled(x, k=2.0):
    return x * k


def default_argument(x):
    return scaled(x) + 1


def grad_mode(x):
    return x * (2 if torch.is_grad_enabled() else 3)


WEIGHT = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))


def matmul(x):
    return torch.mm(x, WEIGHT).sin()


def elementwise(x):
    return torch.sin(x) * 3 + x.mean()


def row_sums(x):
    return (x @ x.T).sum(-1)


SCALE = 2.0


def global_read(x):
    return x * SCALE


def make_closure(k):
    def closure(x):
        return x * k + 1

    return closure


def traced(fn):
    @functools.wraps(fn)
    def wrapper(self, x):
        return fn(self, x)

    return wrapper


class Wrapped(nn.Module):
    """pytorch#195346: a forward decorated with functools.wraps."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    @traced
    def forward(self, x):
        return self.lin(x).relu()


def sigmoid_forward(self, x):
    return self.lin(x).sigmoid()


class Normed(nn.Module):
    """BatchNorm: training uses the batch's statistics, eval the running ones."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        return self.norm(self.lin(x))


def _x(*shape, dtype=torch.float32):
    return torch.randn(*(shape or (4, 8)), generator=torch.Generator().manual_seed(0), dtype=dtype)


# ---- the cases: (what to compile, its input, the change) --------------------------------


def _rebind(owner, name, value):
    def change():
        setattr(owner, name, value)

    return change


def _module_rebind(module, name, value):
    return _rebind(sys.modules[module], name, value)


CASES = {
    # name: (target factory, input factory, change: a state change or a context, or a
    # "compile" of another target)
    "rebound_global": (
        lambda: rebound_global,
        _x,
        ("state", _module_rebind(__name__, "helper", helper_changed)),
    ),
    "module_attribute": (lambda: module_attribute, _x, ("state", _rebind(ops, "act", torch.tanh))),
    "default_argument": (
        lambda: default_argument,
        _x,
        ("state", _rebind(scaled, "__defaults__", (3.0,))),
    ),
    "grad_mode": (lambda: grad_mode, _x, ("context", torch.no_grad)),
    "autocast": (
        lambda: matmul,
        lambda: _x(4, 8),
        ("context", lambda: torch.autocast("cpu", torch.bfloat16)),
    ),
    "dtype": (lambda: elementwise, _x, ("input", lambda: _x(dtype=torch.float64))),
    "input_shape": (lambda: row_sums, _x, ("input", lambda: _x(6, 8))),
    "global_read": (lambda: global_read, _x, ("state", _module_rebind(__name__, "SCALE", 5.0))),
    "closure": (lambda: make_closure(2.0), _x, ("compile", lambda: make_closure(3.0))),
    "wraps_forward": (
        Wrapped,
        lambda: _x(4, 8),
        ("state", _rebind(Wrapped, "forward", traced(sigmoid_forward))),
    ),
    "training_flag": (Normed, lambda: _x(4, 8), ("module", lambda m: m.eval())),
}


def _frames() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _compare(got, expected) -> tuple[float, bool]:
    got, expected = (
        (got if isinstance(got, tuple) else (got,)),
        (expected if isinstance(expected, tuple) else (expected,)),
    )
    err, alike = 0.0, len(got) == len(expected)
    for g, e in zip(got, expected):
        alike &= g.dtype == e.dtype and g.shape == e.shape and g.requires_grad == e.requires_grad
        if g.shape == e.shape:
            err = max(err, (g.double() - e.double()).abs().max().item())
    return err, alike


def _seeded(factory):
    torch.manual_seed(0)
    return factory()


def run_case(name: str) -> dict:
    make_target, make_input, (kind, change) = CASES[name]
    target, x = _seeded(make_target), make_input()
    compiled = torchfarm.compile(target)
    before = _frames()
    first = _compare(compiled(x), target(x))
    first_frames = _frames() - before
    before = _frames()
    if kind == "state":
        change()
        got, expected = compiled(x), target(x)
    elif kind == "context":
        with change():
            got, expected = compiled(x), target(x)
    elif kind == "input":
        y = change()
        got, expected = compiled(y), target(y)
    elif kind == "module":
        change(target)
        got, expected = compiled(x), target(x)
    else:  # another target of the same code: the package is the same one
        other = _seeded(change)
        got, expected = torchfarm.compile(other)(x), other(x)
    changed = _compare(got, expected)
    return {
        "first_frames": first_frames,
        "first_err": first[0],
        "first_alike": first[1],
        "changed_frames": _frames() - before,
        "changed_err": changed[0],
        "changed_alike": changed[1],
    }


def states() -> dict:
    return {name: run_case(name) for name in CASES}


def _loss(out) -> torch.Tensor:
    first = out[0] if isinstance(out, tuple) else out
    return first.float().square().mean()


def _build(name: str):
    if name == "blocks":  # bench/first_result.py's model
        from tests.models import TransformerBlock

        torch.manual_seed(0)
        model = nn.Sequential(TransformerBlock(128, 4), TransformerBlock(128, 4), nn.LayerNorm(128))
        return model, (torch.randn(4, 16, 128),)
    from coverage.architectures import build

    return build(name, scale="tiny")


def model(name: str) -> dict:
    reference, inputs = _build(name)
    expected = reference(*inputs)
    _loss(expected).backward()
    trained, _ = _build(name)
    serialized = []
    dumps = serialize.dumps
    serialize.dumps = lambda gm: serialized.append(1) or dumps(gm)
    out = torchfarm.compile(trained)(*inputs)
    _loss(out).backward()
    grads = [p.grad for p in trained.parameters() if p.grad is not None]
    ref_grads = [p.grad for p in reference.parameters() if p.grad is not None]
    flat = out if isinstance(out, tuple) else (out,)
    return {
        "frames": _frames(),
        "sources": [r.source for r in history],
        "payload_s": [r.timings.get("payload_s") for r in history],
        "serialized": len(serialized),
        "out_err": _compare(out, expected)[0],
        "grad_err": max((g - r).abs().max().item() for g, r in zip(grads, ref_grads)),
        "grads": len(grads) == len(ref_grads),
        # exact sums: a restored hit and the fresh compile of the first process must agree
        "sums": [t.double().sum().item() for t in (*flat, *grads) if isinstance(t, torch.Tensor)],
    }


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    what = sys.argv[1]
    print(json.dumps(states() if what == "states" else model(sys.argv[2])))
