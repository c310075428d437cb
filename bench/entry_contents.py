"""What a farm entry's bytes are made of (issue 52): an Artifact's fields, and of each compiled
graph in it its output code, its Triton bundle by kernel (entries and bytes, the statically
launchable autotuners and their configs) and the rest of its pickle. Unpickles the artifact:
run it on entries this bench's own worker wrote, nowhere else.

    python -m bench.entry_contents ARTIFACT_FILE   (the Artifact's protobuf bytes)

bench/gpu/run.py's hit part writes it for each new entry (MODEL-entry-contents.json).
"""

from __future__ import annotations

import json
import pickle
import sys
from collections import defaultdict


def contents(artifact_bytes: bytes) -> dict:
    """The byte counts of one Artifact (protobuf bytes)."""
    from torchfarm.proto import torchfarm_pb2 as pb

    artifact = pb.Artifact.FromString(artifact_bytes)
    found = {
        "artifact_bytes": len(artifact_bytes),
        "inductor_bytes": len(artifact.inductor),
        "natives_bytes": sum(len(n.binary) for n in artifact.natives),
        "tuned_configs": len(artifact.tuned_configs),
        "tuned_configs_bytes": sum(len(v) for v in artifact.tuned_configs.values()),
        "graph_code_bytes": len(artifact.graph_code),
        "graphs": [],
    }
    if artifact.inductor:
        found["graphs"] = [_graph(g) for g in _compiled_graphs(pickle.loads(artifact.inductor))]
    return found


def _compiled_graphs(root, depth: int = 6) -> list:
    """Every CompiledFxGraph reachable from `root` through attributes, tuples, lists and
    dicts (the bundled AOTAutograd entry holds the forward's and the backward's)."""
    from torch._inductor.output_code import CompiledFxGraph

    found, seen, todo = [], set(), [(root, 0)]
    while todo:
        value, level = todo.pop()
        if id(value) in seen or level > depth:
            continue
        seen.add(id(value))
        if isinstance(value, CompiledFxGraph):
            found.append(value)
        elif isinstance(value, dict):
            todo += [(v, level + 1) for v in value.values()]
        elif isinstance(value, (list, tuple)):
            todo += [(v, level + 1) for v in value]
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            todo += [(v, level + 1) for v in vars(value).values()]
    return found


def _graph(graph) -> dict:
    """One compiled graph's bytes: output code, Triton files by kernel, autotuners, the rest."""
    from torchfarm.torch_adapter.compile.triton_selection import kernel_name

    bundle = getattr(graph, "_triton_bundle", None)
    kernels: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name -> [entries, bytes]
    extensions: dict[str, int] = defaultdict(int)
    for entry in getattr(bundle, "kernel_artifacts", None) or []:
        stem = kernel_name([a.filename for a in entry.artifacts]) or "?"
        kernels[stem][0] += 1
        for artifact in entry.artifacts:
            kernels[stem][1] += len(artifact.payload)
            extensions[artifact.filename.rsplit(".", 1)[-1]] += len(artifact.payload)
    autotuners = getattr(bundle, "static_autotuners", None) or []
    return {
        "pickled_bytes": len(pickle.dumps(graph)),
        "source_code_bytes": len(graph.source_code or ""),
        "triton_entries": sum(k[0] for k in kernels.values()),
        "triton_file_bytes": sum(k[1] for k in kernels.values()),
        "triton_bytes_by_extension": dict(extensions),
        "static_autotuners": len(autotuners),
        "static_autotuner_configs": sum(len(a.kernel.compile_results) for a in autotuners),
        "static_autotuners_pickled_bytes": len(pickle.dumps(autotuners)),
        "kernels": {
            name: {"entries": n, "bytes": size}
            for name, (n, size) in sorted(kernels.items(), key=lambda kv: -kv[1][1])
        },
    }


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        print(json.dumps(contents(f.read()), indent=1))
