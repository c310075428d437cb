"""`torchfarm cache`: look at and manage the farm's cache (ls, show, stats, rm, purge,
export, import). Talks to Redis directly (`--redis`, or TORCHFARM_REDIS_URL): it is an
operator's tool, run where the farm's Redis is reachable. `--json` on every command prints
one JSON document for scripts.
"""

from __future__ import annotations

import collections
import json
import re
import sys
import time

import redis
import typer
import zstandard
from google.protobuf.message import DecodeError
from rich.console import Console
from rich.table import Table

from torchfarm import signing
from torchfarm.cache.artifacts import digest_of
from torchfarm.cache.store import Store, entry_dict, entry_from_dict
from torchfarm.contract import shape_guards
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import GatewaySettings, WorkerSettings

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Inspect and manage the farm's cache (talks to Redis directly).",
)
BUNDLE_FORMAT = "torchfarm-bundle-v1"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}

RedisOption = typer.Option(None, "--redis", help="Redis URL [TORCHFARM_REDIS_URL]")
JsonOption = typer.Option(False, "--json", help="print one JSON document")


def _store(redis_url: str | None) -> Store:
    settings = WorkerSettings.from_env()
    url = redis_url or settings.redis_url
    store = Store.from_url(url, settings.broker_url)
    try:
        store.artifacts.redis.ping()
    except redis.RedisError as e:
        typer.echo(
            f"torchfarm cache: cannot reach Redis at {url} ({e}); "
            "pass --redis or set TORCHFARM_REDIS_URL",
            err=True,
        )
        raise typer.Exit(2) from e
    return store


def parse_age(text: str) -> float:
    """'90s', '30m', '12h', '7d', '2w' -> seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if not match:
        raise typer.BadParameter(f"{text!r}: expected a number and a unit (s, m, h, d, w)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _matches(
    row: dict,
    target: str | None,
    mode: str | None,
    tenant: str | None,
    older_than: float | None,
    now: float,
) -> bool:
    return (
        (target is None or target in row.get("target", "") or target in row.get("pool", ""))
        and (mode is None or row.get("mode") == mode)
        and (tenant is None or row.get("tenant") == tenant)
        and (older_than is None or now - row["last_used"] >= older_than)
    )


def _summary(row: dict) -> dict:
    """An entry without its bulky fields (graph code, op counts, kernels, objects)."""
    return {
        k: v for k, v in row.items() if k not in ("graph_code", "op_counts", "kernels", "objects")
    }


def _console() -> Console:
    """Rich output; piped output gets wide rows, so `| grep` sees whole keys."""
    return Console(width=None if sys.stdout.isatty() else 200)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _resolve(store: Store, prefix: str) -> str:
    found = [k for k, _ in store.artifacts.keys() if k.startswith(prefix)]
    if len(found) != 1:
        raise typer.BadParameter(f"{prefix!r} matches {len(found)} keys; give more of the key")
    return found[0]


@app.command("ls")
def ls(
    target: str = typer.Option(None, help="substring of the target or pool"),
    mode: str = typer.Option(None, help="default, reduce-overhead, max-autotune, ..."),
    tenant: str = typer.Option(None, help="tenant that first built the entry"),
    older_than: str = typer.Option(None, help="unused for at least this long, e.g. 7d"),
    sort: str = typer.Option("age", help="age (most recently used first), hits or size"),
    limit: int = typer.Option(50, help="rows to show (0: all)"),
    redis_url: str = RedisOption,
    as_json: bool = JsonOption,
) -> None:
    """List cache entries."""
    now = time.time()
    age = parse_age(older_than) if older_than else None
    rows = [r for r in _store(redis_url).rows() if _matches(r, target, mode, tenant, age, now)]
    order = {
        "age": lambda r: -r["last_used"],
        "hits": lambda r: -r["hits"],
        "size": lambda r: -r.get("size", 0),
    }
    if sort not in order:
        raise typer.BadParameter(f"--sort {sort!r}: one of {', '.join(order)}")
    rows.sort(key=order[sort])
    rows = rows[:limit] if limit else rows
    if as_json:
        typer.echo(json.dumps([_summary(r) for r in rows], indent=1))
        return
    table = Table(
        "key",
        "digest",
        "mode",
        "tenant",
        "target",
        "bytes",
        "hits",
        "compile s",
        "created",
        "last used",
    )
    for r in rows:
        table.add_row(
            r["key"][:16],
            r["digest"][:12],
            r.get("mode", ""),
            r.get("tenant", ""),
            r.get("target", "")[:48],
            f"{r.get('size', 0):,}",
            str(r["hits"]),
            f"{r.get('compile_seconds', 0):.1f}",
            _age(now - r.get("created", now)),
            _age(now - r["last_used"]),
        )
    _console().print(table)


@app.command()
def show(
    key: str = typer.Argument(..., help="a key or a unique prefix of one"),
    redis_url: str = RedisOption,
    as_json: bool = JsonOption,
) -> None:
    """One key: its entries, guards, metadata, readable graph and kernels."""
    store = _store(redis_url)
    key = _resolve(store, key)
    metas = store.artifacts.entries(key)
    if as_json:
        typer.echo(json.dumps({"key": key, "entries": [entry_dict(m) for m in metas]}, indent=1))
        return
    console = _console()
    for meta in metas:
        e = entry_dict(meta)
        console.rule(f"{key}  entry {e['digest'][:16]}")
        for name in (
            "mode",
            "tenant",
            "target",
            "pool",
            "torch_version",
            "size",
            "stored_bytes",
            "compile_seconds",
            "hits",
            "nodes",
            "tuned_kernels",
            "worker",
        ):
            console.print(f"[bold]{name}[/bold]: {e.get(name, '')}")
        console.print(f"[bold]created[/bold]: {time.ctime(e.get('created', 0))}")
        console.print(f"[bold]guards[/bold]: {shape_guards.describe(meta.guards) or '(none)'}")
        kernels = e.get("kernels", [])
        console.print(
            f"[bold]kernels[/bold] ({len(kernels)}): "
            + ", ".join(f"{k['name']} ({k.get('source_bytes', 0):,} B source)" for k in kernels)
        )
        objects = e.get("objects", [])
        if objects:
            console.print(
                f"[bold]compiled objects[/bold] ({len(objects)}): "
                + ", ".join(f"{o['source_sha256']} ({o['bytes']:,} B)" for o in objects)
            )
        console.print(
            "[bold]ops[/bold]: "
            + ", ".join(f"{op}×{n}" for op, n in sorted(e.get("op_counts", {}).items()))
        )
        console.print("[bold]graph[/bold]:")
        console.print(e.get("graph_code", ""), markup=False, highlight=False)


@app.command()
def stats(redis_url: str = RedisOption, as_json: bool = JsonOption) -> None:
    """Totals (entries, bytes, hits, misses, hit rate, compile seconds saved) and per pool."""
    result = _store(redis_url).summary()
    if as_json:
        typer.echo(json.dumps(result, indent=1))
        return
    console = _console()
    for name, value in result.items():
        if name != "pools":
            console.print(
                f"[bold]{name}[/bold]: {value:,}"
                if isinstance(value, int)
                else f"[bold]{name}[/bold]: {value}"
            )
    table = Table("pool", "entries", "bytes", "hits", "misses", "compiles", "compile s")
    for name, p in sorted(result["pools"].items()):
        table.add_row(
            name or "(unknown)",
            str(p["entries"]),
            f"{int(p['bytes']):,}",
            str(int(p.get("hits", 0))),
            str(int(p.get("misses", 0))),
            str(int(p.get("compiles", 0))),
            f"{p.get('compile_seconds', 0):.1f}",
        )
    console.print(table)


@app.command()
def rm(
    key: str = typer.Argument(..., help="a key or a unique prefix of one"),
    redis_url: str = RedisOption,
    as_json: bool = JsonOption,
) -> None:
    """Remove a key with all its entries and blobs."""
    store = _store(redis_url)
    key = _resolve(store, key)
    removed = store.artifacts.drop(key)
    typer.echo(
        json.dumps({"key": key, "entries_removed": removed})
        if as_json
        else f"removed {key} ({removed} entries)"
    )


@app.command()
def purge(
    older_than: str = typer.Option(None, help="unused for at least this long, e.g. 7d"),
    target: str = typer.Option(None, help="substring of the target or pool"),
    everything: bool = typer.Option(False, "--all", help="purge every entry"),
    redis_url: str = RedisOption,
    as_json: bool = JsonOption,
) -> None:
    """Remove every key that matches the filters (at least one filter, or --all)."""
    if not (older_than or target or everything):
        raise typer.BadParameter("give --older-than, --target, or --all")
    store = _store(redis_url)
    age, now = (parse_age(older_than) if older_than else None), time.time()
    keys = sorted({r["key"] for r in store.rows() if _matches(r, target, None, None, age, now)})
    removed = sum(store.artifacts.drop(k) for k in keys)
    typer.echo(
        json.dumps({"keys_removed": len(keys), "entries_removed": removed})
        if as_json
        else f"removed {len(keys)} keys ({removed} entries)"
    )


@app.command("export")
def export(
    path: str = typer.Argument(..., help="bundle file to write"),
    target: str = typer.Option(None, help="only entries whose target/pool has this"),
    redis_url: str = RedisOption,
    as_json: bool = JsonOption,
) -> None:
    """Write entries (artifact and metadata) to a bundle, e.g. to warm another farm."""
    store = _store(redis_url)
    bundle = pb.CacheBundle(format=BUNDLE_FORMAT)
    for r in store.rows():
        if not _matches(r, target, None, None, None, 0):
            continue
        entry = entry_from_dict(r)
        data = store.artifacts.read(r["key"], entry)
        if data is None:
            continue  # corrupt: dropped by read, not exported
        entry.ClearField("hits")
        entry.ClearField("last_hit")
        bundle.entries.add(
            key=r["key"],
            digest=entry.digest,
            meta_json=json.dumps(entry_dict(entry)),
            artifact=data,
        )
    with open(path, "wb") as f:
        f.write(zstandard.ZstdCompressor(level=10).compress(bundle.SerializeToString()))
    typer.echo(
        json.dumps({"entries": len(bundle.entries), "path": path})
        if as_json
        else f"exported {len(bundle.entries)} entries to {path}"
    )


@app.command("import")
def import_(
    path: str = typer.Argument(..., help="bundle file written by `export`"),
    trust_keys: list[str] = typer.Option(
        None,
        "--trust-key",
        help="a public key (base64) whose entries you trust; repeatable "
        "[default: TORCHFARM_VERIFY_KEYS]",
    ),
    unsigned: bool = typer.Option(
        False, "--unsigned", help="also import entries no trusted key signed (clients skip them)"
    ),
    redis_url: str = RedisOption,
    as_json: bool = JsonOption,
) -> None:
    """Load a bundle. Every entry's digest, format and signature are checked first: an entry
    that no trusted key signed refuses the whole bundle (nothing imported) unless --unsigned.
    Entries keep the signature they came with, never re-signed with this farm's key: a client
    loads them only if it trusts their origin's key (the gateway's TORCHFARM_VERIFY_KEYS, or
    its own pins), and each records that key (`signed_by`). Entries private to a tenant are
    dropped and counted: a bundle places nothing in a tenant's own namespace."""
    try:
        with open(path, "rb") as f:
            bundle = pb.CacheBundle.FromString(zstandard.ZstdDecompressor().decompress(f.read()))
    except (OSError, zstandard.ZstdError, ValueError, DecodeError) as e:
        raise typer.BadParameter(f"{path}: not a torchfarm bundle ({e})") from e
    if bundle.format != BUNDLE_FORMAT:
        raise typer.BadParameter(
            f"{path}: bundle format {bundle.format!r}, expected {BUNDLE_FORMAT!r}"
        )
    served = signing.Verifier.parse(GatewaySettings.from_env().verify_keys).public_keys
    try:
        trusted = signing.Verifier(trust_keys or served)
    except ValueError as e:
        raise typer.BadParameter(f"--trust-key / TORCHFARM_VERIFY_KEYS: {e}") from e
    entries, untrusted, private = [], [], 0
    now = time.time()
    for item in bundle.entries:
        meta = _checked_entry(path, item)
        if meta.private:
            private += 1
            continue
        meta.signed_by = _origin(trusted, item.key, meta) or ""
        meta.imported = now
        if not meta.signed_by:
            untrusted.append(item.key)
        entries.append((item, meta))
    if untrusted and not unsigned:
        names = ", ".join(trusted.public_keys) or "none (--trust-key, TORCHFARM_VERIFY_KEYS)"
        typer.echo(
            f"torchfarm cache import: {path}: {len(untrusted)} of {len(entries)} entries are "
            f"not signed by a trusted key (first: {untrusted[0][:16]}); nothing imported. "
            f"Trusted keys: {names}. --unsigned imports them anyway (no client loads them).",
            err=True,
        )
        raise typer.Exit(1)
    if untrusted:
        typer.echo(
            f"!!! WARNING: importing {len(untrusted)} entries that no trusted key signed "
            "(--unsigned): clients will not load them !!!",
            err=True,
        )
    signers = collections.Counter(meta.signed_by for _, meta in entries if meta.signed_by)
    unserved = sorted(set(signers) - set(served))
    if unserved:
        typer.echo(
            f"note: clients load the entries signed by {', '.join(unserved)} only once that "
            "key is among the gateway's TORCHFARM_VERIFY_KEYS (or the keys clients pin)",
            err=True,
        )
    store = _store(redis_url)
    for item, meta in entries:
        store.artifacts.put_new(item.key, item.artifact, meta)
    if as_json:
        result = {
            "entries": len(entries),
            "unsigned": len(untrusted),
            "private_dropped": private,
            "signed_by": dict(signers),
        }
        typer.echo(json.dumps(result))
        return
    typer.echo(
        f"imported {len(entries)} entries"
        + (f" ({len(untrusted)} unsigned)" if untrusted else "")
        + (f"; dropped {private} private to a tenant" if private else "")
    )


def _checked_entry(path: str, item: pb.BundleEntry) -> pb.EntryMeta:
    """An entry's metadata, once its artifact matches its digest, size and guards."""
    try:
        meta = entry_from_dict(json.loads(item.meta_json))
        guards = pb.Artifact.FromString(item.artifact).guards  # protobuf only: no code runs
    except Exception as e:  # JSON, protobuf JSON or protobuf parse errors
        raise typer.BadParameter(
            f"{path}: entry {item.key[:16]} is malformed ({e}); nothing imported"
        ) from e
    if (
        digest_of(item.artifact) != item.digest
        or meta.digest != item.digest
        or meta.size != len(item.artifact)
        or guards != meta.guards
        or not re.fullmatch(r"[0-9a-f]{64}", item.key)
    ):
        raise typer.BadParameter(
            f"{path}: entry {item.key[:16]} fails its digest check; nothing imported"
        )
    return meta


def _origin(trusted: signing.Verifier, key: str, meta: pb.EntryMeta) -> str | None:
    """The trusted key that signed the entry for the graph its index key names, or None: a
    shared entry's index key is the graph's public key itself, which the signature covers."""
    if (meta.public_key or key) != key:
        return None
    return signing.entry_signer(trusted, key, meta)
