"""One architecture in one fresh process: eager, local torch.compile if asked, then the farm.

Usage: client.py NAME {first,second} DEVICE SCALE [local]  (TORCHFARM_ADDR / _TOKEN from the env)
  first:  eager, local Inductor if `local` is given, and the farm (the farm's first sight of
          the graphs: misses)
  second: eager and the farm only (a fresh process on the same farm: hits)
Prints one JSON line: per phase (infer, train), each way's time to its first result, its
largest difference from eager, and whether it is within the tolerance.

Dynamo's `allow_rnn` is on for every way: with its default (off) `nn.LSTM` and `nn.GRU` run
eagerly and Dynamo hands no graph of an RNN model to any backend, local or farm.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from architectures import build  # noqa: E402

from torchfarm.client import backend  # noqa: E402

# PyTorch's own accuracy check (torch._dynamo.utils.same) with the tolerances of its
# HuggingFace benchmark runner: 1e-3 for inference, 1e-2 for training.
TOLERANCE = {"infer": 1e-3, "train": 1e-2}
torch._dynamo.config.allow_rnn = True


def _loss(out) -> torch.Tensor:
    # transformers tasks return (loss, logits); the others a tensor
    return out[0] if isinstance(out, tuple) else out.float().pow(2).mean()


def step(model, inputs, phase: str) -> list[torch.Tensor]:
    """Inference outputs, or a training step's outputs, gradients and buffers after it."""
    if phase == "infer":
        model.eval()
        with torch.no_grad():
            out = model(*inputs)
        return [t for t in (out if isinstance(out, tuple) else (out,))]
    model.train()
    out = model(*inputs)
    _loss(out).backward()
    outs = [t.detach() for t in (out if isinstance(out, tuple) else (out,))]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return outs + grads + [b.detach().clone() for b in model.buffers()]


def _max_diff(ref: list, res: list) -> float:
    return (
        max(
            ((a.double() - b.double()).abs().max().item() if a.numel() else 0.0)
            for a, b in zip(ref, res)
        )
        if ref
        else 0.0
    )


def _way(base, inputs, phase, reference, compile_with) -> dict:
    torch._dynamo.reset()
    backend.history.clear()
    model = copy.deepcopy(base)
    compiled = torch.compile(model, backend=compile_with)
    started = time.perf_counter()
    try:
        result = step(compiled, inputs, phase)
    except Exception as e:
        return {
            "ok": False,
            "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
            "trace": traceback.format_exc()[-2000:],
        }
    seconds = time.perf_counter() - started
    same = len(result) == len(reference) and torch._dynamo.utils.same(
        reference, result, tol=TOLERANCE[phase], equal_nan=True
    )
    row = {
        "ok": bool(same),
        "seconds": round(seconds, 2),
        "max_diff": _max_diff(reference, result) if len(result) == len(reference) else None,
        "graphs": len(backend.history) if compile_with == "torchfarm" else None,
        "sources": [r.source for r in backend.history] if compile_with == "torchfarm" else None,
        "why": sorted(
            {
                r.why[:200] + " ... " + r.why[-600:] if len(r.why) > 800 else r.why
                for r in backend.history
                if r.why
            }
        ),
        "result": result,
    }
    if not same:
        row["error"] = f"differs from eager by {row['max_diff']} (tolerance {TOLERANCE[phase]})"
    return row


def main(name: str, run: str, device: str, scale: str, *flags: str) -> None:
    base, inputs = build(name, device, scale)
    report = {"name": name, "run": run, "device": device, "scale": scale, "phases": {}}
    for phase in ("infer", "train"):
        reference = step(copy.deepcopy(base), inputs, phase)
        ways = {}
        if run == "first" and "local" in flags:
            ways["local"] = _way(base, inputs, phase, reference, "inductor")
        ways["farm"] = _way(base, inputs, phase, reference, "torchfarm")
        local, farm = ways.get("local", {}), ways["farm"]
        if local.get("result") is not None and farm.get("result") is not None:
            farm["diff_to_local"] = _max_diff(local["result"], farm["result"])
        for way in ways.values():
            way.pop("result", None)
        report["phases"][phase] = ways
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
