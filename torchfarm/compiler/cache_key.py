"""The cache key, computed by the gateway from content alone (never taken from a client).

key = sha256(key format, payload bytes, canonical target, canonical options[, tenant]). The
tenant takes part only for a private request (CompileRequest.private). The payload
holds the graph, its input metadata and the ShapeEnv without size hints, so the same model
traced anywhere, at any batch size that keeps its symbols, gives the same key; the entries
under a key differ by their guards. See docs/cache.md for what goes in and why.
"""

from __future__ import annotations

import hashlib
import json

from google.protobuf import json_format

from torchfarm.compiler import trace_state
from torchfarm.proto import torchfarm_pb2 as pb

KEY_FORMAT = b"torchfarm-key-v2"


def _canonical(message) -> bytes:
    fields = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def canonical_options(options: pb.Options) -> pb.Options:
    """Options with the config patches re-encoded canonically (sorted, compact JSON) and
    the trace state checked; raises ValueError on anything malformed."""
    patches = json.loads(options.config_patches_json) if options.config_patches_json else {}
    if not isinstance(patches, dict):
        raise ValueError("config_patches_json must be a JSON object")
    trace_state.validate(options.state)
    state = pb.TraceState()
    state.CopyFrom(options.state)
    state.autocast[:] = sorted(set(options.state.autocast))
    return pb.Options(
        mode=options.mode or "default",
        config_patches_json=json.dumps(patches, sort_keys=True, separators=(",", ":"))
        if patches
        else "",
        state=state,
    )


def job_id(key: str, size_hints) -> str:
    """One compile: the key plus one trace's size hints (an entry's guards come from them)."""
    hints = json.dumps(sorted(size_hints.items()), separators=(",", ":"))
    return hashlib.sha256(f"{key}\0{hints}".encode()).hexdigest()


def cache_key(
    payload: bytes, target: pb.Target, options: pb.Options, private_to: str | None = None
) -> str:
    """The key of a request; `private_to` (a tenant) makes it that tenant's alone."""
    h = hashlib.sha256(KEY_FORMAT)
    parts = [payload, _canonical(target), _canonical(canonical_options(options))]
    if private_to is not None:
        parts.append(f"private:{private_to}".encode())
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()
