"""The client's program: the first key is the head, positions in order, a manifest's entries
fetched once each in the background and taken once."""

import threading

from torchfarm.client.prefetch import Program
from torchfarm.proto import torchfarm_pb2 as pb


def test_the_first_key_is_the_head_and_positions_follow():
    program = Program()
    places = [program.place(key) for key in ("a" * 64, "b" * 64, "a" * 64)]
    assert [(p.head, p.position) for p in places] == [("a" * 64, 0), ("a" * 64, 1), ("a" * 64, 2)]


def test_a_manifest_is_fetched_in_the_background_once_per_key():
    program = Program()
    fetched: list[str] = []
    done = threading.Semaphore(0)

    def fetch(entry: pb.ManifestEntry) -> str:
        fetched.append(entry.key)
        done.release()
        return f"artifact of {entry.key}"

    manifest = pb.Manifest(
        entries=[pb.ManifestEntry(key=k, digest="d" * 64, position=i) for i, k in enumerate("bc")]
    )
    program.prefetch(manifest, fetch, parallel=2)
    program.prefetch(manifest, fetch, parallel=2)  # the same manifest again: nothing new
    for _ in range(2):
        assert done.acquire(timeout=10)
    job = program.take("b")
    assert job is not None and job.result() == "artifact of b"
    assert program.take("b") is None  # taken once
    assert program.take("x") is None
    assert sorted(fetched) == ["b", "c"]


def test_a_prefetched_entry_is_used_only_where_its_guards_hold():
    from torchfarm.client import fetch
    from torchfarm.client.prefetch import program
    from torchfarm.compiler import guards

    failing, holding = "e" * 64, "f" * 64
    artifacts = {
        failing: pb.Artifact(guards=guards.parse("1 == 2", 0)),
        holding: pb.Artifact(),
    }
    program.prefetch(
        pb.Manifest(entries=[pb.ManifestEntry(key=k, position=1) for k in artifacts]),
        lambda entry: fetch.Fetched(artifacts[entry.key], pb.ArtifactHeader(source="hit"), {}),
        parallel=1,
    )
    assert fetch.prefetched(pb.Ask(key=failing), []) is None  # the normal Get runs
    used = fetch.prefetched(pb.Ask(key=holding), [])
    assert used is not None and used.prefetched and used.header.source == "hit"
    assert fetch.prefetched(pb.Ask(key=holding), []) is None  # taken once
