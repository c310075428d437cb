"""The failure limiter and the authenticator on a fake clock (issue 27, finding 4; issue 50,
item 3): a guesser's failures spend its address's guesses, never a token id's; a made token
is served whatever was guessed at its address; a legacy token gets the same answer right or
wrong from an address out of guesses, except on a connection that proved it before."""

import re

import pytest
from typer.testing import CliRunner

from torchfarm.cli import app
from torchfarm.gateway import auth
from torchfarm.gateway.auth import LEGACY, AccessRefused, Authenticator, FailureLimiter, Refusal

PEER = "ipv4:10.0.0.7:51234"
ALICE, ADMIN, STRANGER = auth.make_token(), auth.make_token(), auth.make_token()
LEGACY_TOKEN = "bob-token-9876543210"  # not made by `torchfarm token`


def _metadata(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


def _authenticator(legacy_tokens: bool = True, tenants: bool = True):
    now = [100.0]
    limiter = FailureLimiter(burst=2, every_s=1.0, clock=lambda: now[0])
    table = {auth.hash_token(ALICE): "alice", auth.hash_token(LEGACY_TOKEN): "bob"}
    return Authenticator(
        table if tenants else {}, {auth.hash_token(ADMIN): "ops"}, limiter, legacy_tokens
    )


def _answer(call, token: str | None, peer: str = PEER) -> str | Refusal:
    try:
        return call(_metadata(token), peer)
    except AccessRefused as refused:
        return refused.why


def _with_id(token: str, secret: str) -> str:
    return f"tf_{auth.token_id(token)}_{secret}"


def test_a_made_token_carries_an_id_and_a_256_bit_secret():
    made = auth.make_token()
    match = re.fullmatch(r"tf_([0-9a-f]{16})_([A-Za-z0-9_-]{43})", made)
    assert match and auth.token_id(made) == match.group(1)
    assert auth.make_token() != made
    for weak in ("tf_0123456789abcdef_short", "tf_xyz_" + "s" * 43, "alice-token", ""):
        assert auth.token_id(weak) == LEGACY
    result = CliRunner().invoke(app, ["token", "alice"])
    token, entry = result.stdout.split()
    assert auth.token_id(token) != LEGACY and entry == f"alice:{auth.hash_token(token)}"


@pytest.mark.parametrize(
    "right, rpcs", [(ALICE, "tenant"), (ADMIN, "admin")], ids=["tenant", "admin"]
)
def test_guesses_at_a_made_tokens_public_id_never_refuse_its_owner(right, rpcs):
    authenticator = _authenticator()
    call = getattr(authenticator, rpcs)
    guesses = [_answer(call, _with_id(right, f"guess{i:040d}")) for i in range(3)]
    assert guesses == [Refusal.UNKNOWN, Refusal.UNKNOWN, Refusal.LIMITED]
    for _ in range(40):  # the owner, at the guesser's address, between its guesses
        assert _answer(call, right) in ("alice", "ops")
        assert _answer(call, _with_id(right, "g" * 43)) is Refusal.LIMITED


def test_a_limited_address_answers_the_same_for_a_right_legacy_token_on_a_new_connection():
    authenticator = _authenticator()
    tenant_connection, new_connection = PEER, "ipv4:10.0.0.7:60000"
    assert _answer(authenticator.tenant, LEGACY_TOKEN, tenant_connection) == "bob"
    guesses = [_answer(authenticator.tenant, f"guess-{i}") for i in range(3)]
    assert guesses == [Refusal.UNKNOWN, Refusal.UNKNOWN, Refusal.LIMITED]
    # A new connection is refused before its token is compared: no oracle for the guesser.
    assert _answer(authenticator.tenant, LEGACY_TOKEN, new_connection) is Refusal.LIMITED
    assert _answer(authenticator.tenant, "guess-x", tenant_connection) is Refusal.LIMITED
    for _ in range(40):  # the tenant's own channel proved the token: served throughout
        assert _answer(authenticator.tenant, LEGACY_TOKEN, tenant_connection) == "bob"
    authenticator.limiter.clock = lambda: 101.0  # a second later: one more guess
    assert _answer(authenticator.tenant, LEGACY_TOKEN, new_connection) == "bob"


def test_a_strangers_failures_at_the_same_address_never_refuse_a_valid_token():
    authenticator = _authenticator()
    for i in range(20):  # no token, legacy guesses, made-up and foreign ids: all fail
        for token in (None, f"guess-{i}", _with_id(STRANGER, f"g{i:040d}"), auth.make_token()):
            assert _answer(authenticator.tenant, token) in (Refusal.UNKNOWN, Refusal.LIMITED)
            assert _answer(authenticator.admin, token) in (Refusal.UNKNOWN, Refusal.LIMITED)
        assert _answer(authenticator.tenant, ALICE) == "alice"
        assert _answer(authenticator.admin, ADMIN) == "ops"
    assert _answer(authenticator.tenant, LEGACY_TOKEN) is Refusal.LIMITED  # a new connection
    assert _answer(authenticator.tenant, LEGACY_TOKEN, "ipv4:10.0.0.8:1") == "bob"


def test_missing_tokens_spend_no_budget():
    authenticator = _authenticator()
    for _ in range(10):
        assert _answer(authenticator.tenant, None) is Refusal.UNKNOWN
    assert _answer(authenticator.tenant, LEGACY_TOKEN) == "bob"


def test_admin_guesses_are_limited_on_an_open_farm_too():
    authenticator = _authenticator(tenants=False)
    assert _answer(authenticator.tenant, None) == auth.OPEN_TENANT
    guesses = [_answer(authenticator.admin, _with_id(ADMIN, f"g{i:040d}")) for i in range(3)]
    assert guesses == [Refusal.NOT_ADMIN, Refusal.NOT_ADMIN, Refusal.LIMITED]
    assert _answer(authenticator.admin, "legacy-guess") is Refusal.NOT_ADMIN  # its own budget
    assert _answer(authenticator.admin, ADMIN) == "ops"


def test_legacy_tokens_can_be_refused():
    authenticator = _authenticator(legacy_tokens=False)
    assert _answer(authenticator.tenant, LEGACY_TOKEN) is Refusal.UNKNOWN
    assert _answer(authenticator.tenant, ALICE) == "alice"


def test_the_failure_budget_refills_one_per_interval():
    now = [100.0]
    limiter = FailureLimiter(burst=2, every_s=1.0, clock=lambda: now[0])
    guesser, other = ("ipv4:10.0.0.7", LEGACY), ("ipv4:10.0.0.8", LEGACY)
    for _ in range(2):
        assert limiter.retry_after_s(guesser) == 0
        limiter.failed(guesser)
    assert limiter.retry_after_s(guesser) == pytest.approx(1.0)
    assert limiter.retry_after_s(other) == 0
    now[0] += 1.0
    assert limiter.retry_after_s(guesser) == 0
    limiter.failed(guesser)
    assert limiter.retry_after_s(guesser) > 0


def test_a_flood_of_addresses_keeps_the_legacy_buckets():
    limiter = FailureLimiter(burst=2, every_s=1.0, clock=lambda: 100.0)
    legacy = ("ipv4:10.0.0.7", LEGACY)
    limiter.failed(legacy)
    limiter.failed(legacy)
    for i in range(FailureLimiter.MAX_BUCKETS + 10):
        limiter.failed((f"ipv6:[fd00::{i:x}]", auth.MADE))
    assert len(limiter._buckets) <= FailureLimiter.MAX_BUCKETS
    assert limiter.retry_after_s(legacy) > 0
