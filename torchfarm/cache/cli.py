"""`torchfarm cache`: look at and manage the farm's cache (ls, show, stats, rm, purge,
export, import, drop-kernels). Each command is an Admin RPC of the gateway (`--addr`/`--token`,
or TORCHFARM_ADDR / TORCHFARM_ADMIN_TOKEN: a token listed in its TORCHFARM_ADMINS), so an
operator needs no store credentials. `--redis URL` (or `--direct`, TORCHFARM_REDIS_URL) talks
to the cache's Redis itself instead: the recovery mode, for a farm whose gateway is down.
Both run the same operations (cache/admin.py); this module only picks the source and
formats. `--json` on every command prints one JSON document for scripts.
"""

from __future__ import annotations

import io
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, Protocol, TypeVar

import grpc
import redis
import typer
from kombu.utils.url import maybe_sanitize_url
from rich.console import Console
from rich.table import Table

from torchfarm import signing
from torchfarm.cache import admin
from torchfarm.cache.admin import CacheAdmin
from torchfarm.cache.store import Store, entry_dict
from torchfarm.contract import shape_guards
from torchfarm.errors import TorchfarmError, WrongBlobStore
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import AdminSettings, GatewaySettings, WorkerSettings

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Inspect and manage the farm's cache (through the gateway with an admin token; "
    "--redis URL for direct store access).",
)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_T = TypeVar("_T")

AddrOption = typer.Option(None, "--addr", help="gateway host:port [TORCHFARM_ADDR]")
TokenOption = typer.Option(None, "--token", help="an admin token [TORCHFARM_ADMIN_TOKEN]")
RedisOption = typer.Option(
    None, "--redis", help="recovery: the cache's Redis URL, used directly instead of the gateway"
)
DirectOption = typer.Option(
    False, "--direct", help="recovery: the cache's Redis at TORCHFARM_REDIS_URL, directly"
)
JsonOption = typer.Option(False, "--json", help="print one JSON document")


class CommandFailed(TorchfarmError):
    """A command the source refused; the message says why."""


class Source(Protocol):
    """Where the cache commands run: the gateway's Admin service, or the store itself."""

    def ls(self, request: pb.ListRequest) -> pb.ListReply: ...
    def show(self, request: pb.ShowRequest) -> pb.ShowReply: ...
    def stats(self) -> dict: ...
    def drop(self, key: str) -> int: ...
    def purge(self, request: pb.PurgeRequest) -> pb.PurgeReply: ...
    def drop_kernels(self, pool: str) -> int: ...
    def export(self, request: pb.ExportRequest) -> Iterator[bytes]: ...
    def import_bundle(
        self, data: bytes, trust_keys: list[str], unsigned: bool
    ) -> pb.ImportReply: ...
    def close(self) -> None: ...


class GatewaySource:
    """The Admin RPCs, with an admin token."""

    def __init__(self, settings: AdminSettings):
        from torchfarm.client.remote import open_channel
        from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc

        self.settings = settings
        # A channel of its own, closed after the command: never one that an earlier
        # command's gateway, gone since, left backing off.
        self.channel = open_channel(settings.addr, settings.tls_ca)
        self.stub = pb_grpc.AdminStub(self.channel)
        self.metadata = [("authorization", f"Bearer {settings.token}")] if settings.token else []

    def close(self) -> None:
        self.channel.close()

    def _call(self, method: str, request: Any) -> Any:
        call = getattr(self.stub, method)
        try:
            return call(request, metadata=self.metadata, timeout=self.settings.timeout_s)
        except grpc.RpcError as e:
            raise CommandFailed(self._why(e)) from None

    def _why(self, e: grpc.RpcError) -> str:
        code = e.code()
        hint = {
            grpc.StatusCode.UNAVAILABLE: f" (is the gateway at {self.settings.addr}?)",
            grpc.StatusCode.UNAUTHENTICATED: " (--token / TORCHFARM_ADMIN_TOKEN)",
            grpc.StatusCode.PERMISSION_DENIED: " (a tenant's token: the cache commands need "
            "one listed in the gateway's TORCHFARM_ADMINS)",
        }.get(code, "")
        return f"{code.name}: {e.details()}{hint}"

    def ls(self, request: pb.ListRequest) -> pb.ListReply:
        return self._call("List", request)

    def show(self, request: pb.ShowRequest) -> pb.ShowReply:
        return self._call("Show", request)

    def stats(self) -> dict:
        return json.loads(self._call("Stats", pb.StatsRequest()).json)

    def drop(self, key: str) -> int:
        return self._call("Drop", pb.DropRequest(key=key)).entries

    def purge(self, request: pb.PurgeRequest) -> pb.PurgeReply:
        return self._call("Purge", request)

    def drop_kernels(self, pool: str) -> int:
        return self._call("DropKernels", pb.DropKernelsRequest(pool=pool)).generation

    def export(self, request: pb.ExportRequest) -> Iterator[bytes]:
        try:
            for chunk in self.stub.Export(
                request, metadata=self.metadata, timeout=self.settings.timeout_s
            ):
                yield chunk.data
        except grpc.RpcError as e:
            raise CommandFailed(self._why(e)) from None

    def import_bundle(self, data: bytes, trust_keys: list[str], unsigned: bool) -> pb.ImportReply:
        if trust_keys or unsigned:
            raise CommandFailed(
                "--trust-key and --unsigned apply to direct store access (--redis) only: "
                "through the gateway, entries must be signed by one of its TORCHFARM_VERIFY_KEYS"
            )
        step = 1 << 20
        chunks = (pb.BundleChunk(data=data[i : i + step]) for i in range(0, len(data), step))
        return self._call("Import", chunks)


class StoreSource:
    """Recovery: the operations run here, on the cache's Redis."""

    def __init__(self, store: Store):
        self.cache = CacheAdmin(store)

    def close(self) -> None:
        """Nothing to end: the store's pooled connections go with the command's process."""

    def _run(self, operation: Callable[[], _T]) -> _T:
        try:
            return operation()
        except admin.CacheOperationRefused as e:
            raise CommandFailed(str(e)) from None

    def ls(self, request: pb.ListRequest) -> pb.ListReply:
        return self._run(lambda: self.cache.ls(request))

    def show(self, request: pb.ShowRequest) -> pb.ShowReply:
        return self._run(lambda: self.cache.show(request))

    def stats(self) -> dict:
        return json.loads(self.cache.stats().json)

    def drop(self, key: str) -> int:
        return self._run(lambda: self.cache.drop(pb.DropRequest(key=key))).entries

    def purge(self, request: pb.PurgeRequest) -> pb.PurgeReply:
        return self._run(lambda: self.cache.purge(request))

    def drop_kernels(self, pool: str) -> int:
        request = pb.DropKernelsRequest(pool=pool)
        return self._run(lambda: self.cache.drop_kernels(request)).generation

    def export(self, request: pb.ExportRequest) -> Iterator[bytes]:
        yield self._run(lambda: self.cache.export(request))

    def import_bundle(self, data: bytes, trust_keys: list[str], unsigned: bool) -> pb.ImportReply:
        served = signing.Verifier.parse(GatewaySettings.from_env().verify_keys).public_keys
        try:
            trusted = signing.Verifier(trust_keys or served)
        except ValueError as e:
            raise CommandFailed(f"--trust-key / TORCHFARM_VERIFY_KEYS: {e}") from None
        try:
            return self.cache.import_bundle(io.BytesIO(data), trusted, served, unsigned)
        except admin.CacheOperationRefused as e:
            hint = "; --unsigned imports them anyway (no client loads them)"
            raise CommandFailed(f"{e}{hint if e.problem is admin.Problem.UNTRUSTED else ''}")


def _source(addr: str | None, token: str | None, redis_url: str | None, direct: bool) -> Source:
    if redis_url or direct:
        return StoreSource(_store(redis_url))
    settings = AdminSettings.from_env(addr=addr, token=token)
    if not settings.addr:
        _fail(
            "no gateway: pass --addr and --token (TORCHFARM_ADDR, TORCHFARM_ADMIN_TOKEN; "
            "`torchfarm up` prints both), or --redis URL for direct store access (recovery)",
            code=2,
        )
    return GatewaySource(settings)


def _fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"torchfarm cache: {message}", err=True)
    raise typer.Exit(code)


def _store(redis_url: str | None) -> Store:
    settings = WorkerSettings.from_env()
    url = redis_url or settings.redis_url
    try:
        store = Store.from_url(url, settings.broker_url, settings.blob_url)
        store.artifacts.redis.ping()
    except ValueError as e:  # a cluster without a broker named (settings.broker_url)
        _fail(str(e), code=2)
    except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
        shown = maybe_sanitize_url(url)  # the password stays off the terminal and its logs
        _fail(
            f"cannot reach Redis at {shown} ({e}); pass --redis or set TORCHFARM_REDIS_URL", code=2
        )
    try:
        store.artifacts.check_store()
    except WrongBlobStore as e:
        _fail(f"{e}; set TORCHFARM_BLOB_URL to it", code=2)
    return store


def parse_age(text: str) -> float:
    """'90s', '30m', '12h', '7d', '2w' -> seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if not match:
        raise typer.BadParameter(f"{text!r}: expected a number and a unit (s, m, h, d, w)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _filter(
    target: str | None = None,
    mode: str | None = None,
    tenant: str | None = None,
    older_than: str | None = None,
) -> pb.EntryFilter:
    return pb.EntryFilter(
        target=target or "",
        mode=mode or "",
        tenant=tenant or "",
        unused_for_s=parse_age(older_than) if older_than else 0.0,
    )


def _row(row: pb.CacheRow) -> dict:
    """A row as `ls --json` prints it: the entry's fields without the bulky ones."""
    fields = {k: v for k, v in entry_dict(row.entry).items() if k not in admin.BULKY}
    return dict(fields, key=row.key, last_used=row.last_used)


def _console() -> Console:
    """Rich output; piped output gets wide rows, so `| grep` sees whole keys."""
    return Console(width=None if sys.stdout.isatty() else 200)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


Conn = tuple[str | None, str | None, str | None, bool]  # --addr, --token, --redis, --direct


def _run(connection: Conn, command: Callable[[Source], _T]) -> _T:
    """`command` on the source the options choose; a refusal exits 1 with its reason."""
    source = _source(*connection)
    try:
        return command(source)
    except CommandFailed as e:
        _fail(str(e))
    finally:
        source.close()


@app.command("ls")
def ls(
    target: str = typer.Option(None, help="substring of the target or pool"),
    mode: str = typer.Option(None, help="default, reduce-overhead, max-autotune, ..."),
    tenant: str = typer.Option(None, help="tenant that first built the entry"),
    older_than: str = typer.Option(None, help="unused for at least this long, e.g. 7d"),
    sort: str = typer.Option("age", help="age (most recently used first), hits or size"),
    limit: int = typer.Option(50, help="rows to show (0: all)"),
    addr: str = AddrOption,
    token: str = TokenOption,
    redis_url: str = RedisOption,
    direct: bool = DirectOption,
    as_json: bool = JsonOption,
) -> None:
    """List cache entries."""
    request = pb.ListRequest(
        filter=_filter(target, mode, tenant, older_than), sort=sort, limit=max(limit, 0)
    )
    rows = _run((addr, token, redis_url, direct), lambda s: s.ls(request)).rows
    if as_json:
        typer.echo(json.dumps([_row(r) for r in rows], indent=1))
        return
    now = time.time()
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
        e = r.entry
        table.add_row(
            r.key[:16],
            e.digest[:12],
            e.mode,
            e.tenant,
            e.target[:48],
            f"{e.size:,}",
            str(e.hits),
            f"{e.compile_seconds:.1f}",
            _age(now - (e.created or now)),
            _age(now - r.last_used),
        )
    _console().print(table)


@app.command()
def show(
    key: str = typer.Argument(..., help="a key or a unique prefix of one"),
    addr: str = AddrOption,
    token: str = TokenOption,
    redis_url: str = RedisOption,
    direct: bool = DirectOption,
    as_json: bool = JsonOption,
) -> None:
    """One key: its entries, guards, metadata, readable graph and kernels."""
    reply = _run((addr, token, redis_url, direct), lambda s: s.show(pb.ShowRequest(key=key)))
    if as_json:
        entries = [entry_dict(m) for m in reply.entries]
        typer.echo(json.dumps({"key": reply.key, "entries": entries}, indent=1))
        return
    console = _console()
    for meta in reply.entries:
        e = entry_dict(meta)
        console.rule(f"{reply.key}  entry {e['digest'][:16]}")
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
def stats(
    addr: str = AddrOption,
    token: str = TokenOption,
    redis_url: str = RedisOption,
    direct: bool = DirectOption,
    as_json: bool = JsonOption,
) -> None:
    """Totals (entries, bytes, hits, misses, hit rate, compile seconds saved) and per pool,
    with the kernels and tuning results the pool's compiles reused and the GEMM candidates
    they benchmarked (issue 28)."""
    result = _run((addr, token, redis_url, direct), lambda s: s.stats())
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
    table = Table(
        "pool", "entries", "bytes", "hits", "misses", "compiles", "compile s",
        "kernels reused", "tuning stored", "tuning reused", "tuning s saved",
        "GEMM candidates benchmarked",
    )  # fmt: skip
    for name, p in sorted(result["pools"].items()):
        table.add_row(
            name or "(unknown)",
            str(p["entries"]),
            f"{int(p['bytes']):,}",
            *(str(int(p.get(n, 0))) for n in ("hits", "misses", "compiles")),
            f"{p.get('compile_seconds', 0):.1f}",
            *(str(int(p.get(n, 0))) for n in ("kernels_reused", "tuning_stored", "tuning_reused")),
            f"{p.get('tuning_seconds_saved', 0):.1f}",
            str(int(p.get("gemm_candidates_benchmarked", 0))),
        )
    console.print(table)


@app.command()
def rm(
    key: str = typer.Argument(..., help="a key or a unique prefix of one"),
    addr: str = AddrOption,
    token: str = TokenOption,
    redis_url: str = RedisOption,
    direct: bool = DirectOption,
    as_json: bool = JsonOption,
) -> None:
    """Remove a key with all its entries and blobs."""

    def remove(source: Source) -> tuple[str, int]:
        full = source.show(pb.ShowRequest(key=key)).key
        return full, source.drop(full)

    full, removed = _run((addr, token, redis_url, direct), remove)
    typer.echo(
        json.dumps({"key": full, "entries_removed": removed})
        if as_json
        else f"removed {full} ({removed} entries)"
    )


@app.command()
def purge(
    older_than: str = typer.Option(None, help="unused for at least this long, e.g. 7d"),
    target: str = typer.Option(None, help="substring of the target or pool"),
    everything: bool = typer.Option(False, "--all", help="purge every entry"),
    addr: str = AddrOption,
    token: str = TokenOption,
    redis_url: str = RedisOption,
    direct: bool = DirectOption,
    as_json: bool = JsonOption,
) -> None:
    """Remove every key that matches the filters (at least one filter, or --all)."""
    if not (older_than or target or everything):
        raise typer.BadParameter("give --older-than, --target, or --all")
    request = pb.PurgeRequest(filter=_filter(target, older_than=older_than), all=everything)
    reply = _run((addr, token, redis_url, direct), lambda s: s.purge(request))
    typer.echo(
        json.dumps({"keys_removed": reply.keys, "entries_removed": reply.entries})
        if as_json
        else f"removed {reply.keys} keys ({reply.entries} entries)"
    )


@app.command("drop-kernels")
def drop_kernels(
    pool: str = typer.Option(..., "--pool", help="the pool, as `stats` lists it"),
    addr: str = AddrOption,
    token: str = TokenOption,
    redis_url: str = RedisOption,
    direct: bool = DirectOption,
    as_json: bool = JsonOption,
) -> None:
    """Make every worker of a pool discard its kernel cache for it (C++ objects, Triton
    entries, tuning results: the pool's and every tenant's) before its next compile."""
    generation = _run((addr, token, redis_url, direct), lambda s: s.drop_kernels(pool))
    typer.echo(
        json.dumps({"pool": pool, "generation": generation})
        if as_json
        else f"pool {pool}: kernel caches dropped (generation {generation}); each worker "
        "discards its own before its next compile"
    )


@app.command("export")
def export(
    path: str = typer.Argument(..., help="bundle file to write"),
    target: str = typer.Option(None, help="only entries whose target/pool has this"),
    addr: str = AddrOption,
    token: str = TokenOption,
    redis_url: str = RedisOption,
    direct: bool = DirectOption,
    as_json: bool = JsonOption,
) -> None:
    """Write entries (artifact and metadata) to a bundle, e.g. to warm another farm, with every
    pool's tuning builds (what its workers measured or tuned: rebuilt where imported)."""
    request = pb.ExportRequest(filter=_filter(target))
    data = _run((addr, token, redis_url, direct), lambda s: b"".join(s.export(request)))
    with open(path, "wb") as f:
        f.write(data)
    bundle = admin.parse_bundle(io.BytesIO(data))
    count, tuning = len(bundle.entries), sum(len(t.builds) for t in bundle.pool_tuning)
    typer.echo(
        json.dumps({"entries": count, "tuning_builds": tuning, "path": path})
        if as_json
        else f"exported {count} entries and {tuning} pool tuning builds to {path}"
    )


@app.command("import")
def import_(
    path: str = typer.Argument(..., help="bundle file written by `export`"),
    trust_keys: list[str] = typer.Option(
        None,
        "--trust-key",
        help="direct mode: a public key (base64) whose entries you trust; repeatable "
        "[default: TORCHFARM_VERIFY_KEYS]",
    ),
    unsigned: bool = typer.Option(
        False,
        "--unsigned",
        help="direct mode: also import entries no trusted key signed (clients skip them)",
    ),
    addr: str = AddrOption,
    token: str = TokenOption,
    redis_url: str = RedisOption,
    direct: bool = DirectOption,
    as_json: bool = JsonOption,
) -> None:
    """Load a bundle. Every entry's digest, format and signature are checked first: an entry
    that no trusted key signed refuses the whole bundle (nothing imported). Through the
    gateway, the trusted keys are its TORCHFARM_VERIFY_KEYS; in direct mode --trust-key (or
    TORCHFARM_VERIFY_KEYS), and --unsigned imports such entries anyway. Entries keep the
    signature they came with, never re-signed with this farm's key: a client loads them only
    if it trusts their origin's key (the gateway's TORCHFARM_VERIFY_KEYS, or its own pins),
    and each records that key (`signed_by`). Entries private to a tenant are dropped and
    counted: a bundle places nothing in a tenant's own namespace. A bundle's pool tuning builds
    (GEMM problems, tuned Triton kernels) are offered to their pools, whose workers build them
    themselves, as they build a shared compile's report: no signature needed."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        admin.parse_bundle(io.BytesIO(data))  # a file that is no bundle is refused before any call
    except (OSError, admin.CacheOperationRefused) as e:
        raise typer.BadParameter(f"{path}: {e}") from e
    reply = _run(
        (addr, token, redis_url, direct),
        lambda s: s.import_bundle(data, trust_keys or [], unsigned),
    )
    if reply.unsigned:
        typer.echo(
            f"!!! WARNING: imported {reply.unsigned} entries that no trusted key signed "
            "(--unsigned): clients will not load them !!!",
            err=True,
        )
    if reply.unserved:
        typer.echo(
            f"note: clients load the entries signed by {', '.join(reply.unserved)} only once "
            "that key is among the gateway's TORCHFARM_VERIFY_KEYS (or the keys clients pin)",
            err=True,
        )
    if as_json:
        result = {
            "entries": reply.entries,
            "unsigned": reply.unsigned,
            "private_dropped": reply.private_dropped,
            "signed_by": dict(reply.signed_by),
            "tuning_builds": reply.tuning_builds,
        }
        typer.echo(json.dumps(result))
        return
    typer.echo(
        f"imported {reply.entries} entries"
        + (f"; {reply.tuning_builds} pool tuning builds offered" if reply.tuning_builds else "")
        + (f" ({reply.unsigned} unsigned)" if reply.unsigned else "")
        + (f"; dropped {dropped} private to a tenant" if (dropped := reply.private_dropped) else "")
    )
