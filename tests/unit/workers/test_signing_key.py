"""A worker signs what it stores, with a key read by its trusted parent only: it refuses to
start without one (unless told to store unusable unsigned entries) and signs only under the
key of the payload it compiled."""

import logging

import pytest

from torchfarm.contract.cache_key import private_key, public_key
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import WorkerSettings
from torchfarm.workers import app, entry


def test_a_worker_without_a_usable_signing_key_refuses_to_start(tmp_path, caplog):
    with pytest.raises(SystemExit, match="no TORCHFARM_SIGNING_KEY.*torchfarm keygen"):
        app.load_signer(WorkerSettings())
    missing = WorkerSettings(signing_key=str(tmp_path / "absent.key"))
    with pytest.raises(SystemExit, match="TORCHFARM_SIGNING_KEY unusable"):
        app.load_signer(missing)
    (tmp_path / "not-a-key").write_text("hello")
    with pytest.raises(SystemExit, match="TORCHFARM_SIGNING_KEY unusable"):
        app.load_signer(WorkerSettings(signing_key=str(tmp_path / "not-a-key")))
    with caplog.at_level(logging.WARNING, logger="torchfarm.worker"):
        assert app.load_signer(WorkerSettings(insecure_unsigned=True)) is None
    assert "INSECURE_UNSIGNED" in caplog.text


def test_the_signed_key_is_the_compiled_payloads_never_the_jobs_word(tmp_path):
    target, options = pb.Target(device="cpu", torch_version="2.13.0"), pb.Options(mode="default")
    graph_key = public_key(b"payload", target, options)
    job = pb.Job(key=graph_key, target=target, options=options, tenant="alice")
    assert entry.graph_key(job, b"payload") == graph_key
    job.private, job.key = True, private_key(graph_key, "alice")
    assert entry.graph_key(job, b"payload") == graph_key
    job.key = public_key(b"another graph", target, options)  # a Job forged on the broker
    with pytest.raises(ValueError, match="is not its payload's"):
        entry.graph_key(job, b"payload")
