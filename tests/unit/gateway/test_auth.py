"""The failure limiter and the authenticator on a fake clock (issue 27, finding 4): the same
answer for the right token and a wrong one while a bucket is empty, and a valid token never
refused for another caller's failures at its address."""

import re

import pytest
from typer.testing import CliRunner

from torchfarm.cli import app
from torchfarm.gateway import auth
from torchfarm.gateway.auth import LEGACY, Authenticator, FailureLimiter, Refusal, Refused

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
    except Refused as refused:
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


@pytest.mark.parametrize("right, rpcs", [(ALICE, "tenant"), (ADMIN, "admin")])
def test_a_limited_bucket_answers_the_same_for_the_right_token(right, rpcs):
    authenticator = _authenticator()
    call = getattr(authenticator, rpcs)
    guesses = [_answer(call, _with_id(right, f"guess{i:040d}")) for i in range(3)]
    assert guesses == [Refusal.UNKNOWN, Refusal.UNKNOWN, Refusal.LIMITED]
    assert _answer(call, right) is Refusal.LIMITED  # not a yes: the token is not compared
    authenticator.limiter.clock = lambda: 101.0  # one more try a second later: it is right
    assert _answer(call, right) in ("alice", "ops")


def test_a_strangers_failures_at_the_same_address_never_refuse_a_valid_token():
    authenticator = _authenticator()
    for i in range(20):  # no token, legacy guesses, made-up and foreign ids: all fail
        for token in (None, f"guess-{i}", _with_id(STRANGER, f"g{i:040d}"), auth.make_token()):
            assert _answer(authenticator.tenant, token) in (Refusal.UNKNOWN, Refusal.LIMITED)
            assert _answer(authenticator.admin, token) in (Refusal.UNKNOWN, Refusal.LIMITED)
        assert _answer(authenticator.tenant, ALICE) == "alice"
        assert _answer(authenticator.admin, ADMIN) == "ops"
    assert _answer(authenticator.tenant, LEGACY_TOKEN) is Refusal.LIMITED  # legacy: shared
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
    assert _answer(authenticator.admin, ADMIN) is Refusal.LIMITED


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


def test_a_flood_of_made_up_ids_keeps_the_legacy_buckets():
    limiter = FailureLimiter(burst=2, every_s=1.0, clock=lambda: 100.0)
    legacy = ("ipv4:10.0.0.7", LEGACY)
    limiter.failed(legacy)
    limiter.failed(legacy)
    for i in range(FailureLimiter.MAX_BUCKETS + 10):
        limiter.failed(("ipv4:10.0.0.7", f"{i:016x}"))
    assert len(limiter._buckets) <= FailureLimiter.MAX_BUCKETS
    assert limiter.retry_after_s(legacy) > 0
