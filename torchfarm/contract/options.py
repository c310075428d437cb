"""Options in canonical form, and the trace-state vocabulary the gateway accepts.

The key hashes canonical options, so two spellings of the same options (patch order,
repeated autocast regions) share entries, and anything outside the vocabulary is refused
before it reaches a worker.
"""

from __future__ import annotations

import json

from torchfarm.contract.modes import MODES
from torchfarm.proto import torchfarm_pb2 as pb

AUTOCAST_DEVICES = ("cuda", "cpu")
AUTOCAST_DTYPES = ("bfloat16", "float16", "float32")
PRECISIONS = ("highest", "high", "medium")


def validate_state(state: pb.TraceState) -> None:
    """Raise ValueError unless every field holds a known value."""
    for entry in state.autocast:
        device, _, dtype = entry.partition(":")
        if device not in AUTOCAST_DEVICES or dtype not in AUTOCAST_DTYPES:
            raise ValueError(
                f"unknown autocast {entry!r}; expected device:dtype with device in "
                f"{AUTOCAST_DEVICES} and dtype in {AUTOCAST_DTYPES}"
            )
    if state.float32_matmul_precision not in ("", *PRECISIONS):
        raise ValueError(f"unknown float32_matmul_precision {state.float32_matmul_precision!r}")


def canonical_options(options: pb.Options) -> pb.Options:
    """Options with the mode checked, the config patches re-encoded canonically (sorted,
    compact JSON) and the trace state checked; raises ValueError on anything malformed."""
    mode = options.mode or "default"
    if mode not in MODES:
        raise ValueError(f"unknown mode {options.mode!r}; one of {', '.join(MODES)}")
    patches = json.loads(options.config_patches_json) if options.config_patches_json else {}
    if not isinstance(patches, dict):
        raise ValueError("config_patches_json must be a JSON object")
    validate_state(options.state)
    state = pb.TraceState()
    state.CopyFrom(options.state)
    state.autocast[:] = sorted(set(options.state.autocast))
    return pb.Options(
        mode=mode,
        config_patches_json=json.dumps(patches, sort_keys=True, separators=(",", ":"))
        if patches
        else "",
        state=state,
    )
