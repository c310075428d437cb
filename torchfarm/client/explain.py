"""A miss told in words (issue 19 item 5): the parts of the key that differ from the nearest
entry of the same program, with both values where they are readable, or the guards that
failed. The log line, GraphRecord.explanation and `torchfarm doctor` say the same sentence;
the last few are kept in a small file so that `torchfarm doctor` can show them later."""

from __future__ import annotations

import json
import time
from pathlib import Path

from torchfarm.contract.cache_key import key_values
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import user_cache_dir

KEPT = 20  # misses kept for `torchfarm doctor`
_NAMES = {
    "graph": "graph (ops, shapes, dtypes or constants)",
    "options.mode": "mode",
    "options.config_patches": "Inductor config patches",
    "target.device": "device",
    "target.torch_version": "torch build",
    "target.python_version": "python",
    "target.cpu_capability": "CPU capability",
    "target.cpu_flags": "CPU flags",
    "target.threads": "threads",
    "target.compiler": "C++ compiler",
    "target.cuda_capability": "CUDA capability",
    "target.cuda_version": "CUDA version",
    "target.triton_version": "triton build",
    "trace_state.grad_enabled": "trace state: grad mode",
    "trace_state.autocast": "trace state: autocast",
    "trace_state.float32_matmul_precision": "trace state: float32 matmul precision",
    "trace_state.deterministic_algorithms": "trace state: deterministic algorithms",
}


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def describe(explanation: pb.MissExplanation, target: pb.Target, options: pb.Options) -> str:
    """The miss in one sentence; `target` and `options` are this client's (its own values)."""
    if explanation.failed_guards:
        return (
            "miss: the farm has entries of this graph, but their shape guards fail here: "
            + "; ".join(explanation.failed_guards)
        )
    if not explanation.nearest_found:
        return "miss: the farm has no entry of this program yet"
    if not explanation.differs:
        return "miss: the nearest entry has the same key parts (it was dropped or is private)"
    own = key_values(target, options)
    parts = []
    for difference in explanation.differs:
        name = _NAMES.get(difference.part, difference.part)
        if difference.part in own:
            parts.append(
                f"{name} ({own[difference.part] or '-'} vs {difference.entry_value or '-'})"
            )
        else:
            parts.append(name)
    return f"miss: differs from the nearest entry in {_and(parts)}"


def _misses_file() -> Path:
    return user_cache_dir() / "misses.jsonl"


def remember(label: str, key: str, text: str) -> None:
    """Keep the explanation for `torchfarm doctor` (best effort: never fails the caller)."""
    path = _misses_file()
    line = json.dumps({"time": time.time(), "label": label, "key": key, "explanation": text})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = path.read_text().splitlines()[-(KEPT - 1) :] if path.exists() else []
        path.write_text("\n".join([*kept, line]) + "\n")
    except OSError:
        pass


def recent(count: int = 5) -> list[dict]:
    """The last `count` misses this machine's user had explained, oldest first."""
    try:
        lines = _misses_file().read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines[-count:]:
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found
