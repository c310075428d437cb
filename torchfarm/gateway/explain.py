"""Why an Ask missed (issue 19 item 5), told against the nearest entry the tenant made.

The client sends a sha256 per part of its key (contract/cache_key.py key_parts), the graph's
structure among them; workers record the same parts, computed from what they compiled, with
each entry, and index the keys of each structure per tenant (cache/structures.py). Among the
entries of the same structure this tenant made, the nearest is the one with most parts equal;
the explanation names the parts that differ (with the entry's value for readable ones), and,
when the asked key itself has entries, the guards that failed on the Ask's sizes.

Entries other tenants made are never compared (issue 27: shared entries of the same program
told one tenant what another compiled, of which architecture, with which options and torch
build). The failed guards are those of the asked key's entries this tenant may hit: the same
ones a Lookup of that key offers it, so they tell it nothing new; another tenant's private
entries are skipped before anything is looked at. The client's parts are only compared, never
stored.
"""

from __future__ import annotations

from torchfarm.cache.store import Store
from torchfarm.contract import shape_guards
from torchfarm.contract.cache_key import STRUCTURE, private_key
from torchfarm.proto import torchfarm_pb2 as pb

MAX_PARTS = 64  # more parts than the key has: the Ask's parts are ignored
MAX_FAILED_GUARDS = 8


def explain(store: Store, ask: pb.Ask, tenant: str) -> pb.MissExplanation:
    """The explanation of a miss of `ask` (already validated) for `tenant`."""
    key = private_key(ask.key, tenant) if ask.private else ask.key
    explanation = pb.MissExplanation(failed_guards=_failed_guards(store, key, tenant, ask.sizes))
    structure = ask.key_parts.get(STRUCTURE, "")
    if not structure or len(ask.key_parts) > MAX_PARTS:
        return explanation
    same = [
        entry
        for other in store.structures.keys(tenant, structure)
        for entry in store.artifacts.entries(other, usage=False)
        if entry.tenant == tenant and entry.key_parts.get(STRUCTURE) == structure
    ]
    explanation.same_program = len(same)
    if not same:
        return explanation
    parts = {p: h for p, h in ask.key_parts.items() if p != STRUCTURE}
    nearest = max(
        same, key=lambda e: (sum(e.key_parts.get(p) == h for p, h in parts.items()), e.created)
    )
    explanation.nearest_found = True
    explanation.differs.extend(
        pb.PartDifference(part=part, entry_value=nearest.key_values.get(part, ""))
        for part, digest in sorted(parts.items())
        if nearest.key_parts.get(part) != digest
    )
    return explanation


def _visible(store: Store, key: str, tenant: str) -> list[pb.EntryMeta]:
    """The key's entries `tenant` may hit: shared ones, and its own private ones."""
    entries = store.artifacts.entries(key, usage=False)
    return [e for e in entries if not e.private or e.tenant == tenant]


def _failed_guards(store: Store, key: str, tenant: str, sizes) -> list[str]:
    """The conditions of the key's visible entries that do not hold for `sizes`, as text."""
    failed: list[str] = []
    for entry in _visible(store, key, tenant):
        for condition in entry.guards.all:
            single = pb.ShapeGuards(all=[condition])
            try:
                holds = shape_guards.evaluate(single, list(sizes))
            except ValueError:  # malformed, or over other inputs than the Ask has
                holds = False
            text = shape_guards.describe(single)
            if not holds and text not in failed:
                failed.append(text)
    return failed[:MAX_FAILED_GUARDS]
