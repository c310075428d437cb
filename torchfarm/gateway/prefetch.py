"""Prefetch on the gateway (issue 19 item 3): remember what each Ask of a tenant's program
was served, and on a hit of the program's head answer with the rest of it, so the client
fetches those graphs in parallel before Dynamo reaches them.

The record holds what the gateway itself served (cache/programs.py); a manifest lists only
entries that still exist and that the tenant may see now, so it leaks nothing a Lookup of
the same keys would not show."""

from __future__ import annotations

from collections.abc import Callable

from torchfarm.cache.programs import Programs
from torchfarm.proto import torchfarm_pb2 as pb

Lookup = Callable[[str, bool, str], tuple[str, list[pb.EntryMeta]]]  # Coordinator.lookup


def record(programs: Programs, ask: pb.Ask, tenant: str, digest: str) -> None:
    """The Ask's graph was served entry `digest`: remember it at its program position."""
    if ask.program.head:
        programs.record(tenant, ask.program.head, ask.program.position, ask.key, digest)


def manifest(programs: Programs, lookup: Lookup, ask: pb.Ask, tenant: str) -> pb.Manifest | None:
    """What to prefetch when `ask`, a program's head, hits: the graphs that followed it last
    time whose entries the tenant may still see; None when there are none."""
    if ask.program.position != 0 or ask.program.head != ask.key:
        return None
    entries = []
    for entry in programs.entries(tenant, ask.key):
        _, visible = lookup(entry.key, ask.private, tenant)
        if any(e.digest == entry.digest for e in visible):
            entries.append(entry)
    return pb.Manifest(entries=entries) if entries else None
