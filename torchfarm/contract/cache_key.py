"""The cache key and the job id, computed from content alone.

public key = sha256(key format, graph, canonical target, canonical options), where the graph
is its descriptor (compiler/descriptor.py, format v4: a static graph's, written without
pickling it) or else its payload bytes (format v3). The client computes it for Lookup (so the
payload is made and uploaded only on a miss, with Compile); the gateway recomputes it from
the descriptor or payload it receives before anything is compiled or written, so a key a
client sends is never trusted for a write, and the worker compiles a payload under a
descriptor's key only once it has found the descriptor to be that payload's. A private key
is derived by the gateway from the public key and the authenticated tenant: no client can
name another tenant's private key.

The payload holds the graph, its input metadata and the ShapeEnv without size hints, so the
same model traced anywhere, at any batch size that keeps its symbols, on any one CUDA device
(payloads name it cuda:0; the target names the device kind only), gives the same key; the
entries under a key differ by their guards. See docs/cache.md for what goes in and why.

`key_parts` names what a key is made of, one sha256 per part, so a miss can say which parts
differ from the nearest entry of the same program (docs/cache.md, "Why did it miss?").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from google.protobuf import json_format
from google.protobuf.message import Message

from torchfarm.contract.options import canonical_options
from torchfarm.proto import torchfarm_pb2 as pb

KEY_FORMAT = b"torchfarm-key-v3"  # v3: entries carry ShapeGuards, not guard text (issue 17)
# v4: the graph by its descriptor (issue 52); v3 keys of those graphs are no longer asked for
DESCRIPTOR_KEY_FORMAT = b"torchfarm-key-v4"
_PRIVATE_FORMAT = b"torchfarm-private-key-v1"


def _canonical(message: Message) -> bytes:
    fields = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def _hash(header: bytes, parts: list[bytes]) -> str:
    h = hashlib.sha256(header)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def public_key(
    payload: bytes, target: pb.Target, options: pb.Options, descriptor: bytes = b""
) -> str:
    """The shared key of a graph (its `descriptor` if it has one, else its payload), target
    and options; ValueError on malformed options."""
    header, graph = (DESCRIPTOR_KEY_FORMAT, descriptor) if descriptor else (KEY_FORMAT, payload)
    return _hash(header, [graph, _canonical(target), _canonical(canonical_options(options))])


def private_key(key: str, tenant: str) -> str:
    """The tenant's own key for the public `key` (the gateway derives it; clients never do)."""
    return _hash(_PRIVATE_FORMAT, [key.encode(), tenant.encode()])


def cache_key(
    payload: bytes,
    target: pb.Target,
    options: pb.Options,
    private_to: str | None = None,
    descriptor: bytes = b"",
) -> str:
    """The key of a request; `private_to` (a tenant) makes it that tenant's alone."""
    key = public_key(payload, target, options, descriptor)
    return key if private_to is None else private_key(key, private_to)


STRUCTURE = "structure"  # the graph's structure digest (compiler/structure.py): not in the key


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _field_values(prefix: str, message: Message) -> dict[str, str]:
    values = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        values[f"{prefix}.{field.name}"] = (
            ",".join(_text(v) for v in value) if field.is_repeated else _text(value)
        )
    return values


def key_values(target: pb.Target, options: pb.Options) -> dict[str, str]:
    """The readable parts of a key and their values, shown beside a client's own when they
    differ: every target field, the mode and every trace-state field (canonical options;
    ValueError on malformed ones). The other parts (graph, structure, config patches) are
    only ever named."""
    canonical = canonical_options(options)
    return {
        **_field_values("target", target),
        "options.mode": canonical.mode,
        **_field_values("trace_state", canonical.state),
    }


def key_parts(
    payload: bytes,
    target: pb.Target,
    options: pb.Options,
    structure: str = "",
    descriptor: bytes = b"",
) -> dict[str, str]:
    """What the public key is made of, part -> sha256: the graph (its descriptor, else its
    payload), each target field, the mode, the config patches and each trace-state field;
    plus the graph's `structure` digest when given (it identifies the program, it is not
    part of the key)."""
    parts = {"graph": hashlib.sha256(descriptor or payload).hexdigest()}
    if structure:
        parts[STRUCTURE] = structure
    parts["options.config_patches"] = hashlib.sha256(
        canonical_options(options).config_patches_json.encode()
    ).hexdigest()
    for part, value in key_values(target, options).items():
        parts[part] = hashlib.sha256(value.encode()).hexdigest()
    return parts


def job_id(
    key: str,
    size_hints: Mapping[str, int],
    float_hints: Mapping[str, float],
    payload: bytes = b"",
) -> str:
    """One compile: the key plus one trace's size hints (an entry's guards come from them) and
    lifted floats' values; for a descriptor's key, the payload too (a payload that is not
    the descriptor's graph fails alone: no other client waits on its job or is answered by
    its remembered failure)."""
    hints = json.dumps(
        sorted(size_hints.items()) + sorted(float_hints.items()), separators=(",", ":")
    )
    graph = f"\0{hashlib.sha256(payload).hexdigest()}" if payload else ""
    return hashlib.sha256(f"{key}\0{hints}{graph}".encode()).hexdigest()
