"""The warm-up's throwaway compile: it goes through a request's compile, leaves nothing for
the request to find (no cache file, no environment change), and its failure is only a slower
first compile."""

import os

import torch

from torchfarm.compiler import inductor, serialize
from torchfarm.workers import warm_compile


def test_the_throwaway_compile_runs_a_requests_path_and_leaves_no_file(tmp_path, monkeypatch):
    cache, triton = tmp_path / "inductor", tmp_path / "triton"
    cache.mkdir()
    triton.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton))
    compiled = []
    original = inductor.compile_payload

    def spy(payload, *args, **kwargs):
        compiled.append(original(payload, *args, **kwargs))
        return compiled[-1]

    monkeypatch.setattr(inductor, "compile_payload", spy)
    environment = dict(os.environ)
    warm_compile.compile_once("cpu")
    assert len(compiled) == 1 and compiled[0].inductor  # a whole artifact, forward and backward
    assert "backward" in compiled[0].inductor.decode("latin-1")
    assert os.listdir(cache) == [] and os.listdir(triton) == []
    # (Inductor's C++ wrapper records a pointer of its own in the environment at any compile)
    inductors_own = {"_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"}
    after = {k: v for k, v in os.environ.items() if k not in inductors_own}
    assert after == {k: v for k, v in environment.items() if k not in inductors_own}


def test_a_request_compiled_after_it_equals_eager(monkeypatch):
    warm_compile.compile_once("cpu")
    captured = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    def f(x):
        return (x.sin() + 1).sum(1)

    x = torch.randn(8, 8)
    torch.compile(f, backend=backend)(x)
    artifact = inductor.compile_payload(
        serialize.dumps(captured[0]), warm_compile._traced("cpu")[1], 0, {}
    )
    compiled = inductor.load_artifact(artifact)
    torch.testing.assert_close(compiled(x)[0], f(x))


def test_a_failed_throwaway_compile_is_reported_and_not_raised(monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(inductor, "compile_payload", fail)
    warm_compile.compile_once("cpu")
    assert "throwaway compile failed" in capsys.readouterr().err
