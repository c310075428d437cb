"""Every ShapeEnv field of the installed torch is either carried by the payload or dropped
on purpose: a field a new torch adds (2.14.1's `foreign_unbacked_symbol_cache`, keyed by
id()) fails here instead of entering the cache key unseen."""

import torch

from torchfarm.torch_adapter.trace import shape_env


def _traced_shape_env() -> shape_env.ShapeEnv:
    """The ShapeEnv of a dynamic graph as Dynamo hands it to a backend (fields that a
    trace sets lazily are there too)."""
    envs = []

    def backend(gm, example_inputs):
        envs.extend(x.node.shape_env for x in example_inputs if isinstance(x, torch.SymInt))
        return gm.forward

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    compiled = torch.compile(model, backend=backend, dynamic=True)
    compiled(torch.randn(4, 8))
    assert envs
    return envs[0]


def _unclassified(env) -> set[str]:
    return set(env.__dict__) - shape_env.KEPT_FIELDS - shape_env.DROPPED_FIELDS


def test_every_field_of_a_fresh_shape_env_is_kept_or_dropped():
    assert _unclassified(shape_env.ShapeEnv()) == set()


def test_every_field_of_a_traced_shape_env_is_kept_or_dropped():
    assert _unclassified(_traced_shape_env()) == set()


def test_no_field_is_both_kept_and_dropped():
    assert shape_env.KEPT_FIELDS & shape_env.DROPPED_FIELDS == set()


def test_the_payload_carries_the_kept_fields_only():
    env = _traced_shape_env()
    kept = shape_env.kept_fields(env)
    assert set(kept) <= shape_env.KEPT_FIELDS
    assert "guards" in kept and shape_env.HINT_FIELD in kept
    assert not set(kept) & {"foreign_unbacked_symbol_cache", "var_to_stack", "log"}
