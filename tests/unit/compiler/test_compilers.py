"""The compiler seam (compiler/compilers.py): a pool's TORCHFARM_COMPILERS, built-ins by
name and others by import path; a request's compiler resolved there or refused, and the
options' compiler name canonical (Inductor's keys unchanged) and checked."""

import pytest

from torchfarm.compiler import compilers
from torchfarm.compiler.aoti import AOTInductorCompiler, inductor_configs
from torchfarm.compiler.exported import BLOB, FED, SENT
from torchfarm.compiler.inductor import InductorCompiler
from torchfarm.contract.cache_key import public_key
from torchfarm.contract.options import canonical_options
from torchfarm.proto import torchfarm_pb2 as pb


class EchoCompiler:
    """A third compiler: a class with `compile`, named in a pool setting."""

    def compile(self, request, context):
        return pb.Artifact(package=request.graph)


def test_the_default_pool_runs_the_built_ins():
    pool = compilers.parse(compilers.DEFAULT)
    assert isinstance(compilers.load("inductor", pool), InductorCompiler)
    assert isinstance(compilers.load("aoti", pool), AOTInductorCompiler)


def test_a_third_compiler_is_a_class_and_a_pool_setting():
    pool = compilers.parse(f"inductor, echo={__name__}:EchoCompiler")
    assert list(pool) == ["inductor", "echo"]
    artifact = compilers.load("echo", pool).compile(
        pb.CompileChildRequest(graph=b"payload"), compilers.CompileContext()
    )
    assert artifact.package == b"payload"
    with pytest.raises(LookupError, match="does not run the compiler 'aoti'"):
        compilers.load("aoti", pool)


@pytest.mark.parametrize(
    "spec, error",
    [
        ("tensorrt", "not built in"),
        ("Bad=x:Y", "malformed compiler name"),
        ("x=nomodule", "name=module:Class"),
    ],
)
def test_a_malformed_pool_setting_is_refused(spec, error):
    with pytest.raises(ValueError, match=error):
        compilers.parse(spec)


def test_the_compiler_is_part_of_the_key_and_inductor_keys_are_unchanged():
    target = pb.Target(device="cpu")
    named = canonical_options(pb.Options(compiler="inductor"))
    assert named.compiler == "" and named == canonical_options(pb.Options())
    assert public_key(b"g", target, named) == public_key(b"g", target, pb.Options())
    assert public_key(b"g", target, pb.Options(compiler="aoti")) != public_key(
        b"g", target, pb.Options()
    )
    with pytest.raises(ValueError, match="malformed compiler name"):
        canonical_options(pb.Options(compiler="../x"))


def test_aoti_refuses_what_a_package_without_weights_cannot_do():
    blob = inductor_configs(pb.Options(mode="default"), weights=BLOB)
    assert blob["always_keep_tensor_constants"]
    assert blob["aot_inductor.package_constants_on_disk_format"] == "binary_blob"
    fed = inductor_configs(pb.Options(mode="default"), weights=FED)
    assert fed["always_keep_tensor_constants"]
    assert "aot_inductor.package_constants_on_disk_format" not in fed
    with pytest.raises(ValueError, match="reduce-overhead"):
        inductor_configs(pb.Options(mode="reduce-overhead"), weights=SENT)
    frozen = pb.Options(config_patches_json='{"freezing": true}')
    with pytest.raises(ValueError, match="freezing"):
        inductor_configs(frozen, weights=BLOB)
    assert inductor_configs(frozen, weights=SENT)["freezing"]
