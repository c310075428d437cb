"""ShapeEnv internals the payload carries: which fields, and the records inside them.

The payload pickles a ShapeEnv's fields, and its bytes are the cache key, so a field enters
it only by name (`KEPT_FIELDS`); `DROPPED_FIELDS` are the ones left out on purpose
(debugging state, caches, per-process ids, source locations). A field in neither, such as
one a new torch adds, stays out of the payload, and tests/unit/torch_adapter/test_shape_env.py
fails until it is classified. The worker unpickles into a fresh ShapeEnv, so a field left
out keeps its fresh value there.

Uses ShapeEnv.__dict__, ShapeGuard and SLoc (torch._guards), ValueRangesSLoc, SymNode
(its `_expr`) and the size hints in `backed_var_to_val`.
Verified: torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

from torch._guards import ShapeGuard, SLoc
from torch.fx.experimental.sym_node import SymNode
from torch.fx.experimental.symbolic_shapes import ShapeEnv, ValueRangesSLoc

__all__ = [
    "DROPPED_FIELDS",
    "HINT_FIELD",
    "KEPT_FIELDS",
    "NO_SLOC",
    "ShapeEnv",
    "ShapeGuard",
    "SymNode",
    "ValueRangesSLoc",
    "expr_of",
    "kept_fields",
]

# Where the ShapeEnv keeps the size hints (symbol -> concrete value); "val_to_var" is its
# inverse. The payload leaves both out and `size_hints` carries them beside it (a lifted
# float's value: `float_hints`).
HINT_FIELD = "backed_var_to_val"

# The state a compile needs. Some are rewritten before pickling (see compiler/serialize.py):
# guards and slocs lose their source locations, hints and deferred asserts are emptied.
KEPT_FIELDS = frozenset(
    {
        "settings",
        "guards",
        "axioms",
        "unique_ids",
        HINT_FIELD,
        "real_tensor_prop_unbacked_vals",
        "var_to_range",
        "var_to_range_sloc",
        "var_to_sources",
        "var_to_hint_override",
        "source_to_var",
        "source_to_symbol",
        "name_to_symbol",  # 2.15: symbol by name, minted in trace order
        "replacements",
        "replacements_slocs",
        "unbacked_renamings",
        "_unbacked_replacements",
        "divisible",
        "exclusion_constraints",
        "size_like",
        "val_to_var",
        "unbacked_symfloat_counter",
        "unbacked_symint_counter",
        "unbacked_alloc_order",
        "unbacked_inputs",
        "pending_fresh_unbacked_symbols",
        "ignorable_fresh_unbacked_symbols",
        "deferred_runtime_asserts",
        "num_deferred_runtime_asserts",
        "frozen",
        "runtime_asserts_frozen",
        "_error_on_new_guards",
        "_resimplify_floor_div_axioms",
        "trace_asserts",
        "specializations",
        "_shape_id_to_unbacked_symbol",
        "_spec_symbol_to_compile_symbol",
        "_shape_spec_pending_assumptions",
        "should_record_events",
        "check_recorded_events",
        "is_recording",
        "_translation_validation_enabled",
    }
)

# Left out: debugging state, source locations, caches and per-process ids.
DROPPED_FIELDS = frozenset(
    {
        "var_to_stack",
        "specialization_stacks",
        "events",
        "log",
        "tracked_fakes",
        "fake_tensor_cache",
        "co_fields",
        "fx_node_cache",
        "_equality_graph",
        "dim_constraints",
        "source_name_to_debug_name",
        "_expr_sym_node_id",
        "_prev_cache_key",
        "_version_counter",
        "counter",
        "symbol_guard_counter",
        "_replacements_version_counter",
        "_symop_cache",  # 2.15: memo of sympy results, filled by whatever ran before
        "foreign_unbacked_symbol_cache",  # 2.14.1: keyed by id() of another ShapeEnv
    }
)

NO_SLOC = SLoc("", None)


def kept_fields(env: ShapeEnv) -> dict:
    """The fields of `env` that the payload carries, in the ShapeEnv's own order."""
    return {k: v for k, v in env.__dict__.items() if k in KEPT_FIELDS}


def expr_of(node: SymNode):
    """A SymNode's expression before replacements (what pickling a SymInt must keep)."""
    return node._expr
