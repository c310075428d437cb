"""Entries only workers can vouch for: Ed25519 signatures over what a client acts on.

Whoever can write an index entry or a blob could make clients load their bytes: artifacts
are pickles. So a worker signs, for every entry it stores, the graph's public key (a hash of
the payload, target and options the client computed itself), the artifact's sha256 and size,
and the entry's shape guards, with the farm's signing key. That key lives with the worker's
trusted parent only: never in a compile sandbox, in Redis, or in a bundle. Clients verify
with the farm's public keys before they evaluate guards or load anything; a Redis writer or a
bundle author without the key cannot forge an entry a client accepts.

Keys: the private key is a PEM file (PKCS#8, mode 0600); public keys travel as the base64 of
their 32 raw bytes, comma-separated where there are several (key rotation).
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterable
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from torchfarm.proto import torchfarm_pb2 as pb

ENTRY_CONTEXT = b"torchfarm-entry-v1\0"


def guards_bytes(guards: pb.ShapeGuards) -> bytes:
    """An entry's shape guards as the bytes a signature covers: their deterministic
    serialization, the one place that says how."""
    return guards.SerializeToString(deterministic=True)


def entry_message(public_key: str, digest: str, size: int, guards: bytes) -> bytes:
    """The bytes a signature covers: fixed fields, length-prefixed, under a versioned tag."""
    parts = [public_key.encode(), digest.encode(), str(size).encode(), guards]
    return ENTRY_CONTEXT + b"".join(len(p).to_bytes(8, "little") + p for p in parts)


class Signer:
    """The farm's signing key (workers only: `torchfarm cache import` keeps the signature an
    entry came with, so a client trusts an imported entry only if it trusts its origin)."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key

    @classmethod
    def from_file(cls, path: str) -> Signer:
        with open(path, "rb") as f:
            key = serialization.load_pem_private_key(f.read(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path}: not an Ed25519 private key (make one: torchfarm keygen)")
        return cls(key)

    @property
    def public_key(self) -> str:
        return encode_public_key(self._key.public_key())

    def sign(self, public_key: str, digest: str, size: int, guards: bytes) -> bytes:
        return self._key.sign(entry_message(public_key, digest, size, guards))


class Verifier:
    """The public keys a client (or an importing operator) trusts."""

    def __init__(self, public_keys: Iterable[str]) -> None:
        self.public_keys = [k for k in public_keys if k]
        self._keys = [decode_public_key(k) for k in self.public_keys]

    @classmethod
    def parse(cls, spec: str) -> Verifier:
        """Comma-separated base64 public keys (TORCHFARM_VERIFY_KEYS)."""
        return cls(k.strip() for k in spec.split(","))

    def __bool__(self) -> bool:
        return bool(self._keys)

    def verify(
        self, signature: bytes, public_key: str, digest: str, size: int, guards: bytes
    ) -> bool:
        """True if any trusted key signed exactly these fields."""
        return self.signer(signature, public_key, digest, size, guards) is not None

    def signer(
        self, signature: bytes, public_key: str, digest: str, size: int, guards: bytes
    ) -> str | None:
        """The trusted key (base64) that signed exactly these fields, or None."""
        message = entry_message(public_key, digest, size, guards)
        for text, key in zip(self.public_keys, self._keys, strict=True):
            try:
                key.verify(signature, message)
                return text
            except InvalidSignature:
                continue
        return None


def encode_public_key(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def decode_public_key(text: str) -> Ed25519PublicKey:
    try:
        raw = base64.b64decode(text, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError as e:
        raise ValueError(f"not an Ed25519 public key (base64 of 32 bytes): {text[:16]!r}") from e


def generate(path: str) -> Signer:
    """Write a new private key to `path` (0600, never overwritten); the signer."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(pem)
    return Signer(key)


class SignedEntry(Protocol):
    """What a signature is checked on: an EntryMeta, or a Candidate the client was offered."""

    @property
    def digest(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def guards(self) -> pb.ShapeGuards: ...
    @property
    def signature(self) -> bytes: ...


def sign_entry(signer: Signer, public_key: str, entry: pb.EntryMeta) -> bytes:
    """The signature of an index entry (digest and size filled in) under a graph's public key."""
    return signer.sign(public_key, entry.digest, entry.size, guards_bytes(entry.guards))


def entry_verifies(verifier: Verifier, public_key: str, entry: SignedEntry) -> bool:
    """Whether a trusted key signed this entry (its digest, size and guards) for the graph."""
    return entry_signer(verifier, public_key, entry) is not None


def entry_signer(verifier: Verifier, public_key: str, entry: SignedEntry) -> str | None:
    """The trusted key (base64) that signed this entry for the graph, or None."""
    return verifier.signer(
        entry.signature, public_key, entry.digest, entry.size, guards_bytes(entry.guards)
    )
