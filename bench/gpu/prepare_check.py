"""Why a prepared graph misses: Dynamo's graphs of one bench model traced on the GPU and on
fake tensors in a process that sees no GPU, compared node by node (issue 30).

    python bench/gpu/prepare_check.py MODEL        prints the first differences per graph
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def capture(name: str, fake: bool) -> list[dict]:
    import torch

    sys.path.insert(0, HERE)
    from client import build, make_step

    from torchfarm.compiler import serialize
    from torchfarm.torch_adapter.trace.fake_device import as_traced_for_real, fake_device
    from torchfarm.torch_adapter.trace.fake_tensors import FakeTensorMode

    graphs: list[dict] = []

    def backend(gm, example_inputs):
        if fake:
            as_traced_for_real(gm)
        nodes = []
        for n in gm.graph.nodes:
            v = n.meta.get("example_value")
            meta = ""
            if isinstance(v, torch.Tensor):
                meta = f"{tuple(v.shape)} {v.stride()} {v.dtype} {v.device} rg={v.requires_grad}"
            elif isinstance(v, (tuple, list)):
                meta = " | ".join(
                    f"{tuple(t.shape)} {t.stride()} {t.dtype}"
                    for t in v
                    if isinstance(t, torch.Tensor)
                )
            target = re.sub(r" at 0x[0-9a-f]+", "", str(n.target))  # addresses differ anyway
            nodes.append(f"{n.op} {n.name} {target} {n.type} {n.args} {n.kwargs} :: {meta}")
        digest = hashlib.sha256(serialize.dumps(gm)).hexdigest()[:16]
        graphs.append({"digest": digest, "nodes": nodes})
        return gm.forward

    def step():
        model, x, spec = build(name)
        make_step(torch.compile(model, backend=backend), model, spec)(*x)

    if fake:
        capability = os.environ.get("BENCH_CAPABILITY", "9.0")  # the GPU this process hides
        with FakeTensorMode(allow_non_fake_inputs=True), fake_device(capability):
            try:
                step()
            except Exception as e:  # the backward without a GPU; the graph is captured
                print(f"fake step stopped: {type(e).__name__}: {e}", file=sys.stderr)
    else:
        step()
    return graphs


def main() -> None:
    if sys.argv[1] == "--capture":
        print(json.dumps(capture(sys.argv[2], sys.argv[3] == "fake")))
        return
    name = sys.argv[1]
    runs = {}
    for kind in ("real", "fake"):
        env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if kind == "fake" else {}))
        out = subprocess.run(
            [sys.executable, __file__, "--capture", name, kind],
            env=env,
            capture_output=True,
            text=True,
        )
        print(out.stderr[-1500:], file=sys.stderr)
        runs[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    for i, (a, b) in enumerate(zip(runs["real"], runs["fake"])):
        print(f"graph {i}: real {a['digest']} fake {b['digest']} same={a['digest'] == b['digest']}")
        diffs = [(x, y) for x, y in zip(a["nodes"], b["nodes"]) if x != y]
        print(f"  {len(a['nodes'])} vs {len(b['nodes'])} nodes, {len(diffs)} differ")
        for x, y in diffs[:12]:
            print(f"  real: {x[:300]}\n  fake: {y[:300]}")


if __name__ == "__main__":
    main()
