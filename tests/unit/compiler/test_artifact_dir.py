"""Where a loaded artifact's files land: one dir per artifact and CUDA device.

Inductor writes a loaded graph's output code under the graph's key only where no file is yet
(CompiledFxGraph.write_to_disk), and ranks of one machine share its cache dir: with one dir
per artifact alone, rank 1 imported rank 0's code, written for cuda:0, and failed with
"tensors on cuda:1 and cuda:0" (a 2-GPU DDP run, torch 2.11)."""

from torchfarm.compiler import inductor
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.compile import standalone


def _dir(artifact: pb.Artifact, device_index: int | None) -> str:
    with inductor._artifact_cache_dir(artifact, device_index) as directory:
        assert standalone.cache_dir() == directory  # what Inductor writes to, inside
        return directory


def test_each_cuda_device_loads_an_artifact_into_a_dir_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    artifact, other = pb.Artifact(inductor=b"graph"), pb.Artifact(inductor=b"other graph")
    as_compiled = _dir(artifact, None)
    assert _dir(artifact, 0) == as_compiled == _dir(artifact, None)  # reused when it loads again
    on_1, on_2 = _dir(artifact, 1), _dir(artifact, 2)
    assert len({as_compiled, on_1, on_2, _dir(other, None)}) == 4
    assert all(d.startswith(str(tmp_path)) for d in (as_compiled, on_1, on_2))
