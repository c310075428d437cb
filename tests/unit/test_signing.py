"""Entry signatures: only the signing key makes a signature a client accepts, over exactly the
fields it acts on."""

import os
import stat

import pytest

from torchfarm import signing
from torchfarm.proto import torchfarm_pb2 as pb

KEY, DIGEST, SIZE, GUARDS = "ab" * 32, "cd" * 32, 1234, b"\x0a\x02guards"


@pytest.fixture
def signer(tmp_path) -> signing.Signer:
    return signing.generate(str(tmp_path / "farm.key"))


def test_a_signature_verifies_with_the_public_key_and_the_key_file_is_private(signer, tmp_path):
    path = tmp_path / "farm.key"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = signing.Signer.from_file(str(path))
    assert again.public_key == signer.public_key
    verifier = signing.Verifier.parse(f" {signer.public_key} ,")
    assert verifier.verify(again.sign(KEY, DIGEST, SIZE, GUARDS), KEY, DIGEST, SIZE, GUARDS)


@pytest.mark.parametrize(
    "changed",
    [
        {"public_key": "ef" * 32},
        {"digest": "00" * 32},
        {"size": SIZE + 1},
        {"guards": b""},
        {"guards": GUARDS + b"\x00"},
    ],
)
def test_a_signature_covers_every_field(signer, changed):
    fields = dict(public_key=KEY, digest=DIGEST, size=SIZE, guards=GUARDS)
    signature = signer.sign(**fields)
    verifier = signing.Verifier([signer.public_key])
    assert not verifier.verify(signature, **{**fields, **changed})


def test_another_key_or_a_damaged_signature_is_refused(signer, tmp_path):
    other = signing.generate(str(tmp_path / "other.key"))
    signature = other.sign(KEY, DIGEST, SIZE, GUARDS)
    assert not signing.Verifier([signer.public_key]).verify(signature, KEY, DIGEST, SIZE, GUARDS)
    both = signing.Verifier([signer.public_key, other.public_key])  # a rotation
    assert both.verify(signature, KEY, DIGEST, SIZE, GUARDS)
    damaged = bytes([signature[0] ^ 1]) + signature[1:]
    assert not both.verify(damaged, KEY, DIGEST, SIZE, GUARDS)
    assert not both.verify(b"", KEY, DIGEST, SIZE, GUARDS)


def test_keys_are_never_overwritten_and_bad_public_keys_are_refused(signer, tmp_path):
    with pytest.raises(FileExistsError):
        signing.generate(str(tmp_path / "farm.key"))
    with pytest.raises(ValueError, match="Ed25519 public key"):
        signing.Verifier.parse("not base64!")
    assert not signing.Verifier.parse("")


def _at_most(n: int) -> pb.ShapeGuards:
    """The guards `t0 <= n`."""
    bound = pb.GuardApply(
        op=pb.GuardApply.LE, args=[pb.GuardExpr(input=0), pb.GuardExpr(constant=n)]
    )
    return pb.ShapeGuards(all=[pb.GuardExpr(apply=bound)])


def test_an_entry_and_the_candidate_a_client_is_offered_verify_alike(signer, tmp_path):
    entry = pb.EntryMeta(digest=DIGEST, size=SIZE, guards=_at_most(4096), tenant="a")
    entry.signature = signing.sign_entry(signer, KEY, entry)
    offered = pb.Candidate(
        digest=entry.digest,
        size=entry.size,
        guards=entry.guards,
        signature=entry.signature,
    )
    trusted = signing.Verifier([signer.public_key])
    assert signing.entry_verifies(trusted, KEY, entry)
    assert signing.entry_verifies(trusted, KEY, offered)
    assert not signing.entry_verifies(trusted, "ef" * 32, offered)  # another graph's key
    offered.guards.CopyFrom(_at_most(4097))  # guards changed after signing
    assert not signing.entry_verifies(trusted, KEY, offered)
    assert signing.guards_bytes(entry.guards) == entry.guards.SerializeToString(deterministic=True)
    offered.ClearField("guards")  # an unguarded entry is a different one
    assert not signing.entry_verifies(trusted, KEY, offered)
