"""Per-call guard cost of a restored frame against Dynamo's own (issue 49 item 2), in one
process: a model's entry frame traced with the skip's package (Dynamo's own guards, identity
included), then restored as a fresh process would (its identity guards built again on this
process's objects); both guard managers are checked alternately on the frame's locals,
min and median over rounds (us per call).

    .venv/bin/python bench/skip_guard_cost.py [llama|qwen3|mistral|gpt2|jit-encoder]
"""

import itertools
import os
import statistics
import sys
import time

import torch
from torch._C._dynamo.eval_frame import _debug_get_precompile_entries
from torch._dynamo import bytecode_transformation
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from torchfarm.torch_adapter.trace import dynamo_package

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


def main(name: str) -> None:
    from skip_loop import build, loss_of

    model, x = build(name)
    kwargs = {"labels": x} if x.dtype == torch.long else {}
    graphs = {}

    def backend(gm, example_inputs):
        graphs[dynamo_package.backend_id(gm)] = gm.forward
        return gm.forward

    package = dynamo_package.new_package()
    dynamo_package.record(package, model)
    loss_of(dynamo_package.optimize(backend, package, None, False)(model)(x, **kwargs)).backward()
    code = getattr(model.forward, "__func__", model.forward).__code__
    traced = _debug_get_cache_entry_list(code)[0].guard_manager
    saved = dynamo_package.dumps(package)
    torch._dynamo.reset()
    bytecode_transformation._unique_id_counter = itertools.count()
    restored_package = dynamo_package.new_package()
    dynamo_package.install(restored_package, model, saved, graphs)
    restored = _debug_get_precompile_entries(code)[0].guard_manager
    frame_locals = {}

    def profile(frame, event, arg):  # the entry frame's locals, from an eager call
        if event == "call" and frame.f_code is code and not frame_locals:
            frame_locals.update(frame.f_locals)

    sys.setprofile(profile)
    model(x, **kwargs)
    sys.setprofile(None)
    assert traced.check(frame_locals) and restored.check(frame_locals)

    def per_call(manager, n=2000):
        started = time.perf_counter()
        for _ in range(n):
            manager.check(frame_locals)
        return (time.perf_counter() - started) / n * 1e6

    rounds = [(per_call(traced), per_call(restored)) for _ in range(15)]
    a, b = zip(*rounds)
    print(
        f"{name}: Dynamo's own (traced) {min(a):.1f} us/call (median {statistics.median(a):.1f}), "
        f"restored {min(b):.1f} (median {statistics.median(b):.1f}): "
        f"{min(b) / min(a):.2f}x by the minima"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llama")
