"""torch.export programs through AOTInductor on a real farm (issues 30, 52): the package comes
back signed, the client writes its own weights into it, and torch's loaders (Python and C++)
run it as it is, equal to eager at the exported dynamic sizes; no weight's bytes reach the
farm; a second request for the program (another tenant, other weights, the CLI) is a hit on
the same package, run with that tenant's weights; weights sent give a self-contained
package; a compiler the pool does not run and a malformed program are refused clearly, and
the farm goes on serving; without a farm the package is built locally; a program whose JSON
runs code when read (its symbolic expressions go through sympify) runs it in the sandbox,
where it reaches nothing."""

import json
import os
import subprocess
import sys
import tempfile
import zipfile

import pytest
import torch

from tests.integration.helpers import TOKENS
from tests.models import exported_block, relative_diff
from torchfarm.client import exported, remote
from torchfarm.compiler.exported import dumps
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings

pytestmark = pytest.mark.integration


def _settings(farm, tenant: str) -> ClientSettings:
    return ClientSettings(
        addr=farm.addr, token=TOKENS[tenant], verify_keys=farm.verify_keys, progress=False
    )


def _run_by_torchs_cpp_loader(path, model) -> float:
    """The package run by torch's C++ AOTIModelPackageLoader (what a C++ serving process
    links), its largest difference from `model` relative to the model's largest value."""
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    x = torch.randn(9, 32)
    with torch.no_grad():
        eager = model(x)
    return ((loader.run([x])[0] - eager).abs().max() / eager.abs().max()).item()


def _entries(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def test_the_default_package_runs_under_torchs_loaders_and_no_weight_leaves_the_client(
    farm, tmp_path, monkeypatch
):
    model, program = exported_block(seed=0)
    sent = []
    real_get = remote.get

    def recording_get(ask, request, *args, **kwargs):  # the real call, its request kept
        received = real_get(ask, request, *args, **kwargs)
        sent.append((ask, request, received.header.source))
        return received

    monkeypatch.setattr(remote, "get", recording_get)
    path = exported.aoti_compile_and_package(
        program, tmp_path / "alice.pt2", settings=_settings(farm, "alice")
    )
    # torch's own loaders run it as it is, equal to eager
    assert relative_diff(torch._inductor.aoti_load_package(path), model) < 1e-5
    assert _run_by_torchs_cpp_loader(path, model) < 1e-5

    # What went to the farm, and what it stored, hold none of the weights' bytes
    # the farm compiled it (this file's programs are its own): on .venv's torch this and the
    # hit below are test_versions.py's AOTInductor check, which runs for the other releases
    ((ask, request, first_source),) = sent
    assert first_source == "miss", first_source
    on_the_wire = ask.SerializeToString() + request.SerializeToString()
    artifact, source = exported.package_artifact(program, settings=_settings(farm, "alice"))
    assert source == "hit" and artifact.package_weights.weights
    for name, tensor in {**program.state_dict, **program.constants}.items():
        values = tensor.detach().numpy().tobytes()
        for start in range(0, len(values), 16):
            assert values[start : start + 16] not in on_the_wire, name
            assert values[start : start + 16] not in artifact.package, name
        assert values in _entries(path)[artifact.package_weights.path], name


def test_another_tenant_with_other_weights_hits_and_gets_its_own_results(farm, tmp_path):
    _, program = exported_block(seed=1)
    first = exported.aoti_compile_and_package(
        program, tmp_path / "alice.pt2", settings=_settings(farm, "alice")
    )

    # Another tenant's model of the same program, other weights, from the CLI: a hit
    other_model, other_program = exported_block(seed=7)
    saved, output = tmp_path / "program.pt2", tmp_path / "bob.pt2"
    torch.export.save(other_program, saved)
    cli = subprocess.run(
        [sys.executable, "-m", "torchfarm", "export", str(saved), "-o", str(output)],
        env=dict(
            os.environ,
            TORCHFARM_ADDR=farm.addr,
            TORCHFARM_TOKEN=TOKENS["bob"],
            TORCHFARM_VERIFY_KEYS=farm.verify_keys,
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert ", hit, " in cli.stdout, cli.stdout
    mine, theirs = _entries(first), _entries(output)
    blob = next(name for name in mine if name.endswith("_weights.blob"))
    assert mine.keys() == theirs.keys() and mine[blob] != theirs[blob]
    assert {n: b for n, b in mine.items() if n != blob} == {
        n: b for n, b in theirs.items() if n != blob
    }
    assert relative_diff(torch._inductor.aoti_load_package(output), other_model) < 1e-5
    # torchfarm's loader feeds a package other weights: the first tenant's, into Bob's
    model, program = exported_block(seed=1)
    assert relative_diff(exported.aoti_load_package(output, program), model) < 1e-5


def test_weights_sent_give_a_package_torch_runs_as_it_is(farm, tmp_path):
    model, program = exported_block(seed=2)
    path = exported.aoti_compile_and_package(
        program, tmp_path / "model.pt2", weights=True, settings=_settings(farm, "alice")
    )
    assert relative_diff(torch._inductor.aoti_load_package(path), model) < 1e-5


def test_a_compiler_the_pool_does_not_run_is_refused_and_the_farm_serves_on(farm):
    _, program = exported_block(seed=3)
    with pytest.raises(remote.FarmError, match="does not run the compiler 'tensorrt'"):
        exported.package_artifact(program, "tensorrt", settings=_settings(farm, "alice"))

    # A payload that is no ExportedProgram: the child's error, then the next request served
    settings = _settings(farm, "alice")
    options = pb.Options(compiler="aoti")
    from torchfarm.compiler.target import local_target
    from torchfarm.contract.cache_key import public_key

    target = local_target()
    garbage = b"\x0a\x05{not json"
    request = pb.CompileRequest(graph=garbage, target=target, options=options)
    ask = pb.Ask(key=public_key(garbage, target, options))
    with pytest.raises(remote.FarmError, match="compile child failed"):
        remote.get(ask, request, settings)
    with tempfile.TemporaryDirectory() as directory:
        _, program = exported_block(seed=4)
        path = exported.aoti_compile_and_package(
            program, os.path.join(directory, "m.pt2"), settings=settings
        )
        assert os.path.getsize(path) > 0


def test_code_in_a_programs_expressions_runs_only_in_the_sandbox(farm, tmp_path):
    marker = tmp_path / "pwned"
    code = f"open({str(marker)!r}, 'w').write('pwned') or 1/0"
    _, program = exported_block(seed=5)
    message = pb.ExportedProgram.FromString(dumps(program))
    document = json.loads(message.program_json)

    def plant(value):  # the first symbolic size's expression runs the code, then is itself
        if isinstance(value, dict):
            if "expr_str" in value:
                value["expr_str"] = f"__import__('builtins').exec({code!r}) or {value['expr_str']}"
                return True
            return any(plant(v) for v in value.values())
        return isinstance(value, list) and any(plant(v) for v in value)

    assert plant(document)
    hostile = json.dumps(document)
    message.program_json = hostile.encode()
    payload = message.SerializeToString()
    settings = _settings(farm, "alice")
    options = pb.Options(compiler="aoti")
    from torchfarm.compiler.target import local_target
    from torchfarm.contract.cache_key import public_key

    target = local_target()
    request = pb.CompileRequest(graph=payload, target=target, options=options)
    with pytest.raises(remote.FarmError, match="compile child failed") as failed:
        remote.get(pb.Ask(key=public_key(payload, target, options)), request, settings)
    # the code ran (the sandbox, not luck, stopped it): its /tmp is private
    assert f"No such file or directory: {str(marker)!r}" in str(failed.value)
    assert not marker.exists()


def test_without_a_farm_the_package_is_built_here_with_one_warning(tmp_path, caplog):
    model, program = exported_block(seed=6)
    with pytest.raises(ValueError, match="reduce-overhead"):  # refused before any call
        exported.aoti_compile_and_package(program, mode="reduce-overhead")
    path = exported.aoti_compile_and_package(
        program, tmp_path / "here.pt2", settings=ClientSettings(addr="", progress=False)
    )
    assert "no farm configured" in caplog.text and "compiling the package locally" in caplog.text
    assert relative_diff(exported.aoti_load_package(path, program), model) < 1e-5
