"""Options in canonical form, and the trace-state vocabulary the gateway accepts.

The key hashes canonical options, so two spellings of the same options (patch order,
repeated autocast regions) share entries, and anything outside the vocabulary is refused
before it reaches a worker.
"""

from __future__ import annotations

import json
import re

from torchfarm.contract import modes
from torchfarm.proto import torchfarm_pb2 as pb

AUTOCAST_DEVICES = ("cuda", "cpu")
AUTOCAST_DTYPES = ("bfloat16", "float16", "float32")
PRECISIONS = ("highest", "high", "medium")
# Options.compiler: Inductor on a Dynamo graph is the default, written "" (so its keys are
# those from before compilers had names); the compilers built in (compiler/compilers.py), and
# any other a pool names (TORCHFARM_COMPILERS), are names of this form.
INDUCTOR, AOTI = "inductor", "aoti"
COMPILER_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def compiler_of(options: pb.Options) -> str:
    """The name of the compiler `options` ask for ("inductor" where they name none)."""
    return options.compiler or INDUCTOR


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
    compact JSON), the trace state and the compiler's name checked; raises ValueError on
    anything malformed. Whether a pool runs the compiler is its workers' to say."""
    mode = modes.checked(options.mode)
    patches = json.loads(options.config_patches_json) if options.config_patches_json else {}
    if not isinstance(patches, dict):
        raise ValueError("config_patches_json must be a JSON object")
    validate_state(options.state)
    compiler = compiler_of(options)
    if not COMPILER_NAME.fullmatch(compiler):
        raise ValueError(f"malformed compiler name {options.compiler!r}")
    state = pb.TraceState()
    state.CopyFrom(options.state)
    state.autocast[:] = sorted(set(options.state.autocast))
    return pb.Options(
        mode=mode,
        config_patches_json=json.dumps(patches, sort_keys=True, separators=(",", ":"))
        if patches
        else "",
        state=state,
        compiler="" if compiler == INDUCTOR else compiler,
    )
