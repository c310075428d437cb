"""The cache key and pool names: content decides, every target field and option counts."""

import pytest

from torchfarm.compiler.target import local_target
from torchfarm.contract.cache_key import cache_key
from torchfarm.contract.options import canonical_options
from torchfarm.contract.pools import pool_name
from torchfarm.proto import torchfarm_pb2 as pb

PAYLOAD = b"graph bytes"


def _target(**changes) -> pb.Target:
    target = pb.Target(
        device="cpu",
        torch_version="2.13.0+gitabc",
        python_version="3.11",
        cpu_capability="AVX512",
        cpu_flags=["avx2", "avx512f", "fma"],
        threads=8,
        compiler="g++ 12.2.0",
    )
    for name, value in changes.items():
        if name == "cpu_flags":
            del target.cpu_flags[:]
            target.cpu_flags.extend(value)
        else:
            setattr(target, name, value)
    return target


def test_key_ignores_json_key_order_and_default_mode():
    a = pb.Options(config_patches_json='{"b": 1, "a": 2}')
    b = pb.Options(mode="default", config_patches_json='{"a":2,"b":1}')
    assert cache_key(PAYLOAD, _target(), a) == cache_key(PAYLOAD, _target(), b)


@pytest.mark.parametrize(
    "change",
    [
        {"cpu_capability": "AVX2"},
        {"cpu_flags": ["avx2", "fma"]},
        {"threads": 4},
        {"torch_version": "2.13.0+gitdef"},
        {"compiler": "g++ 13.1.0"},
        {"python_version": "3.12"},
        {"device": "cuda", "cuda_capability": "9.0"},
        {"triton_version": "3.6.0"},
    ],
)
def test_every_target_field_changes_the_key(change):
    assert cache_key(PAYLOAD, _target(), pb.Options()) != cache_key(
        PAYLOAD, _target(**change), pb.Options()
    )


def test_payload_mode_and_patches_change_the_key():
    base = cache_key(PAYLOAD, _target(), pb.Options())
    assert cache_key(PAYLOAD + b"x", _target(), pb.Options()) != base
    assert cache_key(PAYLOAD, _target(), pb.Options(mode="max-autotune")) != base
    assert cache_key(PAYLOAD, _target(), pb.Options(config_patches_json='{"a": 1}')) != base


def test_config_patches_must_be_an_object():
    with pytest.raises(ValueError):
        canonical_options(pb.Options(config_patches_json="[1, 2]"))


def test_pool_name_follows_isa_and_torch_not_threads():
    assert pool_name(_target()) == pool_name(_target(threads=2, compiler="clang"))
    assert pool_name(_target()) != pool_name(_target(cpu_capability="AVX2"))
    assert pool_name(_target()) != pool_name(_target(cpu_flags=["avx2"]))
    assert pool_name(_target()) != pool_name(_target(torch_version="2.11.0+gitabc"))
    cuda = _target(
        device="cuda", cuda_capability="9.0", cuda_version="13.0", triton_version="3.6.0"
    )
    assert pool_name(cuda).startswith("cuda-sm90-cuda13.0-triton3.6.0")


def test_local_target_describes_this_machine():
    target = local_target()
    assert target.device == "cpu" and target.threads > 0 and target.cpu_capability
    assert target.torch_version.startswith(__import__("torch").__version__)


@pytest.mark.parametrize(
    "state",
    [
        pb.TraceState(grad_enabled=True),
        pb.TraceState(autocast=["cuda:bfloat16"]),
        pb.TraceState(float32_matmul_precision="high"),
        pb.TraceState(deterministic_algorithms=True),
    ],
)
def test_trace_state_changes_the_key(state):
    assert cache_key(PAYLOAD, _target(), pb.Options()) != cache_key(
        PAYLOAD, _target(), pb.Options(state=state)
    )


def test_autocast_order_does_not_change_the_key():
    a = pb.Options(state=pb.TraceState(autocast=["cuda:bfloat16", "cpu:bfloat16"]))
    b = pb.Options(state=pb.TraceState(autocast=["cpu:bfloat16", "cuda:bfloat16"]))
    assert cache_key(PAYLOAD, _target(), a) == cache_key(PAYLOAD, _target(), b)


@pytest.mark.parametrize(
    "state",
    [
        pb.TraceState(autocast=["cuda:int8"]),
        pb.TraceState(autocast=["__import__('os')"]),
        pb.TraceState(float32_matmul_precision="fastest"),
    ],
)
def test_unknown_trace_state_is_refused(state):
    with pytest.raises(ValueError):
        canonical_options(pb.Options(state=state))
