"""The index entry of an artifact a worker compiled: described, keyed and signed here, from
what was compiled; nothing a client or the broker says is taken for it."""

from __future__ import annotations

import functools
import re
import socket

from torchfarm import signing
from torchfarm.cache.artifacts import digest_of
from torchfarm.contract import modes
from torchfarm.contract.cache_key import key_parts, key_values, private_key, public_key
from torchfarm.contract.pools import describe
from torchfarm.proto import torchfarm_pb2 as pb

_DIGEST = re.compile(r"[0-9a-f]{64}")
_GRAPH_CODE_CHARS = 20_000  # the readable graph kept with an entry, for `torchfarm cache show`


def entry_meta(
    job: pb.Job, payload: bytes, data: bytes, artifact: pb.Artifact, pool: str
) -> pb.EntryMeta:
    """The unsigned entry of `artifact` (its protobuf bytes `data`), compiled from `payload`;
    ValueError where the job's key is not its payload's."""
    meta = pb.EntryMeta(
        digest=digest_of(data),
        size=len(data),
        guards=artifact.guards,
        compile_seconds=round(artifact.compile_seconds, 3),
        tenant=job.tenant,
        private=job.private,
        mode=modes.named(job.options.mode),
        pool=pool,
        target=describe(job.target),
        torch_version=job.target.torch_version,
        nodes=sum(artifact.op_counts.values()),
        op_counts=dict(artifact.op_counts),
        kernels=artifact.kernels,
        tuned_kernels=len(artifact.tuned_configs),
        objects=[
            pb.NativeObjectInfo(source_sha256=n.source_sha256[:16], bytes=len(n.binary))
            for n in artifact.natives
        ],
        graph_code=artifact.graph_code[:_GRAPH_CODE_CHARS],
        worker=socket.gethostname(),
        public_key=graph_key(job, payload),
    )
    _record_key_parts(meta, job, payload, artifact.structure)
    return meta


def sign(meta: pb.EntryMeta, signing_key: str) -> None:
    """Vouch for the entry with the farm's key (the file `signing_key`)."""
    meta.signature = signing.sign_entry(signer(signing_key), meta.public_key, meta)


@functools.cache
def signer(path: str) -> signing.Signer:
    return signing.Signer.from_file(path)


def graph_key(job: pb.Job, payload: bytes) -> str:
    """The public key of the payload this worker compiled, recomputed here (what the entry's
    signature names): a Job forged on the broker cannot get another graph's key signed."""
    graph = public_key(payload, job.target, job.options, job.descriptor)
    expected = private_key(graph, job.tenant) if job.private else graph
    if job.key != expected:
        raise ValueError(f"the job's key {job.key[:16]} is not its payload's ({expected[:16]})")
    return graph


def _record_key_parts(meta: pb.EntryMeta, job: pb.Job, payload: bytes, structure: str) -> None:
    """What the entry's key is made of, computed here from what was compiled (a client's parts
    are never stored), to explain the misses of the same program. The structure comes from the
    child: it only groups entries, so a malformed one is left out."""
    if not _DIGEST.fullmatch(structure):
        structure = ""
    meta.key_parts.update(key_parts(payload, job.target, job.options, structure, job.descriptor))
    meta.key_values.update(key_values(job.target, job.options))
