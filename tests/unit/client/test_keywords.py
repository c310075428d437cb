"""The public entry points take torch's keywords as one typed value (`**options`): an unknown
keyword is refused with the TypeError their spelled-out signatures raised, before any work,
and every keyword has its default."""

import pytest

import torchfarm
from torchfarm.client import decorator, exported


@pytest.mark.parametrize(
    "call, refused",
    [
        (lambda: torchfarm.compile(lambda x: x, mode="default", foo=1), "compile() ... 'foo'"),
        (lambda: torchfarm.compile(foo=1), "compile() ... 'foo'"),
        (
            lambda: torchfarm.aoti_compile_and_package(None, "m.pt2", bar=2),
            "aoti_compile_and_package() ... 'bar'",
        ),
        (
            lambda: exported.package_artifact(None, "aoti", weights=True, baz=3),
            "package_artifact() ... 'baz'",
        ),
    ],
)
def test_an_unknown_keyword_is_refused_as_python_refused_it(call, refused):
    with pytest.raises(TypeError) as raised:
        call()
    assert str(raised.value) == refused.replace("...", "got an unexpected keyword argument")


def test_every_keyword_has_its_default():
    assert decorator.DEFAULTS.keys() == decorator.CompileOptions.__annotations__.keys()
    assert exported.DEFAULTS.keys() == exported.PackageOptions.__annotations__.keys()
