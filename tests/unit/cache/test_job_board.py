"""Posting a job (cache/jobs.py) on a bare redis-server: only the holder of the job's claim
posts it, so a run that ended after the claim was taken keeps its outcome."""

import pytest

from torchfarm.cache.store import Store
from torchfarm.proto import torchfarm_pb2 as pb


@pytest.fixture
def board(redis_url):
    store = Store.from_url(redis_url)
    store.jobs.redis.flushdb()
    return store.jobs


def test_a_post_after_the_job_ended_writes_nothing_and_the_outcome_stays(board):
    token = board.claim("j1", 60)
    assert token is not None
    board.finish("j1", pb.JobOutcome(kind=pb.JobOutcome.STORED, digest="d" * 64))
    assert not board.post("j1", token, b"payload")
    state = board.state("j1")
    assert state.outcome is not None and state.outcome.digest == "d" * 64
    assert not state.claimed and board.payload("j1") is None
    again = board.claim("j1", 60)
    assert again is not None and board.post("j1", again, b"payload")  # queued afresh
    state = board.state("j1")
    assert state.outcome is None and state.stage == pb.Progress.QUEUED
    assert board.payload("j1") == b"payload"


def test_only_the_claims_holder_posts(board):
    assert board.claim("j2", 60) is not None
    assert not board.post("j2", "another caller's token", b"payload")
    assert board.payload("j2") is None
