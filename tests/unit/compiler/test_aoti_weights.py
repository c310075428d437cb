"""The weight blob of a package built without the weights (compiler/aoti.py): the client
writes each weight's storage where the layout puts it (strides and storage offsets as the
compile had them, gaps zero) into the package's archive, and refuses weights that are
missing or of another dtype or shape; the child refuses a layout its blob contradicts."""

import zipfile

import pytest
import torch

from torchfarm.compiler import aoti, exported
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.compile.aoti_weights_blob import BlobEntry

BLOB = "model/data/aotinductor/model/w.wrapper_weights.blob"


def _package(tmp_path) -> bytes:
    path = tmp_path / "built.pt2"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("model/data/aotinductor/model/w.wrapper.so", b"\x7fELF")
    return path.read_bytes()


def _weight(name, tensor, offset, storage_bytes, storage_offset=0) -> pb.PackageWeight:
    return pb.PackageWeight(
        tensor=exported.describe(name, tensor),
        offset=offset,
        storage_bytes=storage_bytes,
        storage_offset=storage_offset,
    )


def test_the_weights_land_where_the_layout_puts_them(tmp_path):
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 0.5
    transposed = torch.empty_strided((3, 2), (1, 3), dtype=torch.float32)  # storage (2, 3)
    bias = torch.tensor([7, 8], dtype=torch.int64)
    layout = pb.PackageWeights(path=BLOB, size=192)
    layout.weights.extend(
        [
            _weight("w", weight, 0, 24),
            _weight("t", transposed, 64, 28, storage_offset=1),  # one element before it
            _weight("b", bias, 128, 16),
        ]
    )
    artifact = pb.Artifact(package=_package(tmp_path), package_weights=layout)
    given = {"w": weight, "t": weight.t().contiguous() * 2, "b": bias, "unused": bias}
    aoti.write_package(str(tmp_path / "out.pt2"), artifact, given)

    with zipfile.ZipFile(tmp_path / "out.pt2") as archive:
        assert archive.read("model/data/aotinductor/model/w.wrapper.so") == b"\x7fELF"
        blob = archive.read(BLOB)
    assert len(blob) == 192
    assert blob[:24] == weight.numpy().tobytes() and blob[24:64] == bytes(40)
    stored = torch.frombuffer(bytearray(blob[64:92]), dtype=torch.float32)
    assert torch.equal(stored.as_strided((3, 2), (1, 3), 1), given["t"])
    assert blob[128:144] == bias.numpy().tobytes() and blob[144:] == bytes(48)


def test_missing_or_mismatched_weights_are_refused_by_name(tmp_path):
    weight = torch.ones(4)
    layout = pb.PackageWeights(path=BLOB, size=64, weights=[_weight("w", weight, 0, 16)])
    artifact = pb.Artifact(package=_package(tmp_path), package_weights=layout)
    with pytest.raises(ValueError, match="needs weights not given: w"):
        aoti.write_package(str(tmp_path / "a.pt2"), artifact, {"v": weight})
    with pytest.raises(ValueError, match=r"w: the package was built for float32 \[4\]"):
        aoti.write_package(str(tmp_path / "b.pt2"), artifact, {"w": torch.ones(5)})
    with pytest.raises(ValueError, match="w: the package was built for float32"):
        aoti.write_package(str(tmp_path / "c.pt2"), artifact, {"w": weight.double()})


def test_a_package_without_a_layout_is_written_as_it_came(tmp_path):
    artifact = pb.Artifact(package=_package(tmp_path))
    aoti.write_package(str(tmp_path / "out.pt2"), artifact, {})
    assert (tmp_path / "out.pt2").read_bytes() == artifact.package


def test_the_child_refuses_a_layout_its_blob_contradicts(tmp_path):
    a, b = torch.full((4,), 1.0), torch.full((4,), 2.0)
    path = tmp_path / "p.pt2"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(BLOB, a.numpy().tobytes() + bytes(48) + b.numpy().tobytes() + bytes(48))
    entries = [BlobEntry("a", a, 0, 16), BlobEntry("b", b, 64, 16)]
    with zipfile.ZipFile(path) as archive:
        layout = aoti._layout(archive, [(entries, 128)], {"a": a, "b": b})
        assert [(w.tensor.name, w.offset) for w in layout.weights] == [("a", 0), ("b", 64)]
        swapped = [BlobEntry("a", a, 64, 16), BlobEntry("b", b, 0, 16)]
        with pytest.raises(RuntimeError, match="a is not where the recorded layout puts it"):
            aoti._layout(archive, [(swapped, 128)], {"a": a, "b": b})
        with pytest.raises(RuntimeError, match="its layout says 192"):
            aoti._layout(archive, [(entries, 192)], {"a": a, "b": b})
