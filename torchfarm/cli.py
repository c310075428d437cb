"""`torchfarm` command line: up (embedded farm), gateway, worker, cache, doctor, keygen, token,
target, prepare, export."""

from __future__ import annotations

import os
import signal
import threading

import typer

from torchfarm.cache.cli import app as cache_app
from torchfarm.settings import env

WORKER_CHECK_S = 2.0  # how often `torchfarm up` looks for workers that exited

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="torchfarm: a remote compilation farm for torch.compile",
)
app.add_typer(cache_app, name="cache")


def _logging(level: str) -> None:
    from torchfarm import logs

    logs.setup(level)


@app.command()
def up(
    grpc_port: int = typer.Option(0, help="gateway port (0 picks a free one)"),
    redis_port: int = typer.Option(0, help="redis-server port (0 picks a free one)"),
    host: str = typer.Option("127.0.0.1", help="address the gateway listens on"),
    workers: int = typer.Option(1, help="workers to start"),
    device: str = typer.Option("cpu", help="what the workers compile for: cpu or cuda"),
    sandbox: str = typer.Option("bwrap", help="bwrap, or none (insecure)"),
    tenants: str = typer.Option(
        "", envvar=env.name("TENANTS"), help="tenant:sha256(token),... (empty: an open farm)"
    ),
    admins: str = typer.Option("", envvar=env.name("ADMINS"), help="admin:sha256(token),..."),
    tls_cert: str = typer.Option("", envvar=env.name("TLS_CERT"), help="gateway's PEM chain"),
    tls_key: str = typer.Option("", envvar=env.name("TLS_KEY"), help="its PEM private key"),
    insecure: bool = typer.Option(
        False, envvar=env.name("GATEWAY_INSECURE"), help="plaintext beyond loopback"
    ),
) -> None:
    """Start an embedded local farm. Once every worker has compiled its canary it prints one
    block for the operator (TORCHFARM_ADDR, an admin token it made unless TORCHFARM_ADMINS was
    given, the recovery command), or exits 1 with the reason (a worker's own error)."""
    from torchfarm.errors import FarmNotReady
    from torchfarm.gateway import auth
    from torchfarm.gateway.server import plaintext_refusal
    from torchfarm.local_farm import LocalFarm

    if bool(tls_cert) != bool(tls_key):
        typer.echo("torchfarm up: --tls-cert and --tls-key go together", err=True)
        raise typer.Exit(2)
    refusal = plaintext_refusal(host, bool(tls_cert), insecure)
    if refusal:
        typer.echo(f"torchfarm up: {refusal}", err=True)
        raise typer.Exit(2)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    admin_token = "" if admins else auth.make_token()
    farm = LocalFarm(
        grpc_port=grpc_port,
        redis_port=redis_port,
        host=host,
        workers=workers,
        sandbox=sandbox,
        device=device,
        tenants=tenants,
        admins=admins or f"operator:{auth.hash_token(admin_token)}",
        # Celery's queues and the job board on a redis-server of their own: a cache at its
        # memory limit then never refuses the broker's writes (which ends a Celery worker)
        separate_broker=True,
        tls=(tls_cert, tls_key) if tls_cert else None,
        insecure=insecure,
    )
    try:
        with farm:
            print(_operator_block(farm, admin_token, tenants), flush=True)
            while not stop.wait(WORKER_CHECK_S):
                for restarted in farm.restart_exited_workers():
                    typer.echo(f"torchfarm up: worker {restarted} exited; started again", err=True)
    except FarmNotReady as e:
        typer.echo(f"torchfarm up: the farm is not ready: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo("farm stopped", err=True)


def _operator_block(farm, admin_token: str, tenants: str) -> str:
    """What an operator needs, as `NAME=value` lines a shell can export and `# ` notes, ended
    by an empty line: the address, the admin token (or where to get one), recovery access."""
    url_file = os.path.join(farm.workdir, "redis.url")  # the workdir is the farm's alone (0700)
    with open(os.open(url_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(farm.redis_url)
    lines = [f"TORCHFARM_ADDR={farm.addr}"]
    if admin_token:
        lines.append(f"TORCHFARM_ADMIN_TOKEN={admin_token}")
        lines.append("# admin token made for this farm (shown once): `torchfarm cache ...` uses it")
    else:
        lines.append(
            "# admin: use a token listed in the TORCHFARM_ADMINS given "
            "(`torchfarm token NAME` makes one) as TORCHFARM_ADMIN_TOKEN"
        )
    lines += [
        "# tenants: "
        + (
            "from TORCHFARM_TENANTS (clients set TORCHFARM_TOKEN)"
            if tenants
            else "OPEN farm (no TORCHFARM_TENANTS): anyone who reaches the address may compile"
        ),
        f"# blobs in {farm.blob_url}",
        "# recovery, without the gateway: "
        f'TORCHFARM_BLOB_URL={farm.blob_url} torchfarm cache stats --redis "$(cat {url_file})"',
        f"# logs in {farm.log_dir}; Ctrl-C stops the farm",
        "",
    ]
    return "\n".join(lines)


@app.command()
def gateway(
    host: str = typer.Option(None, help="[TORCHFARM_GATEWAY_HOST]"),
    port: int = typer.Option(None, help="[TORCHFARM_GATEWAY_PORT]"),
    redis_url: str = typer.Option(None, help="[TORCHFARM_REDIS_URL]"),
    insecure: bool = typer.Option(
        None, "--insecure", help="[TORCHFARM_GATEWAY_INSECURE] plaintext beyond loopback"
    ),
    log_level: str = "info",
) -> None:
    """Run the gRPC gateway: TLS (TORCHFARM_TLS_CERT/_KEY) unless it listens on loopback or
    is told --insecure."""
    from torchfarm.gateway.server import serve
    from torchfarm.settings import GatewaySettings

    _logging(log_level)
    serve(GatewaySettings.from_env(host=host, port=port, redis_url=redis_url, insecure=insecure))


@app.command()
def worker(
    pool: str = typer.Option(None, help="[TORCHFARM_POOL] queue to serve; auto = this machine"),
    device: str = typer.Option(None, help="[TORCHFARM_DEVICE] cpu or cuda"),
    redis_url: str = typer.Option(None, help="[TORCHFARM_REDIS_URL]"),
    concurrency: int = typer.Option(None, help="[TORCHFARM_WORKER_CONCURRENCY]"),
    sandbox: str = typer.Option(None, help="[TORCHFARM_SANDBOX] bwrap, or none (insecure)"),
    log_level: str = "info",
) -> None:
    """Run a Celery compile worker for one hardware pool."""
    from torchfarm.settings import WorkerSettings
    from torchfarm.torch_adapter.gate import require_verified_for_worker

    require_verified_for_worker()  # before torch: a worker on an unverified torch never starts
    _logging(log_level)
    settings = WorkerSettings.from_env(
        pool=pool, device=device, redis_url=redis_url, concurrency=concurrency, sandbox=sandbox
    )
    if settings.metrics_port:
        from torchfarm.workers import metrics

        metrics.enable()  # before anything imports prometheus_client
    from torchfarm.workers.app import run_worker

    run_worker(settings)


@app.command()
def doctor(
    addr: str = typer.Option(None, help="[TORCHFARM_ADDR] gateway host:port"),
    token: str = typer.Option(None, help="[TORCHFARM_TOKEN] this tenant's token"),
    device: str = typer.Option("cpu", help="the device your model runs on: cpu or cuda"),
) -> None:
    """Check the farm from this machine: address, gateway, token, target, a round trip."""
    from rich.console import Console
    from rich.table import Table

    from torchfarm.doctor import run_checks
    from torchfarm.settings import ClientSettings

    checks = run_checks(ClientSettings.from_env(addr=addr, token=token), device)
    table = Table(show_header=False, box=None)
    marks = {True: "[green]ok[/green]", False: "[red]FAIL[/red]", None: "[dim]--[/dim]"}
    for check in checks:
        table.add_row(marks[check.ok], check.name, check.detail)
        if check.advice and check.ok is False:
            table.add_row("", "", f"[yellow]→ {check.advice}[/yellow]")
    Console(width=140).print(table)
    raise typer.Exit(1 if any(c.ok is False for c in checks) else 0)


@app.command()
def keygen(path: str = typer.Argument(..., help="private key file to create (mode 0600)")) -> None:
    """Make the farm's entry-signing key: give PATH to workers (TORCHFARM_SIGNING_KEY); the
    printed public key goes to the gateway and clients (TORCHFARM_VERIFY_KEYS)."""
    from torchfarm import signing

    print(signing.generate(path).public_key)


@app.command()
def token(name: str = typer.Argument(..., help="the tenant (or admin) the token is for")) -> None:
    """Make a strong token (a 256-bit secret): prints the token (the tenant's TORCHFARM_TOKEN),
    then its entry for TORCHFARM_TENANTS or TORCHFARM_ADMINS (name:sha256, no secret)."""
    from torchfarm.gateway import auth

    if not name or any(c in name for c in ":, ") or name != name.strip():
        typer.echo("torchfarm token: a name without ':', ',' or spaces", err=True)
        raise typer.Exit(2)
    made = auth.make_token()
    print(made)
    print(f"{name}:{auth.hash_token(made)}")
    typer.echo(
        "line 1: the token, shown once (give it to the tenant; keep it secret); "
        "line 2: its entry for TORCHFARM_TENANTS (or TORCHFARM_ADMINS)",
        err=True,
    )


@app.command()
def target(
    device: str = typer.Option("cpu", help="the device the job runs on: cpu or cuda"),
) -> None:
    """Print this machine's target as JSON: run it on a machine of the job's kind and give
    the file to `torchfarm prepare --target`."""
    from google.protobuf import json_format

    from torchfarm.compiler.target import local_target

    print(json_format.MessageToJson(local_target(device), preserving_proto_field_name=True))


@app.command()
def prepare(
    entry: str = typer.Argument(
        ..., help="module:function that builds the model and runs its first step(s)"
    ),
    target_file: str = typer.Option(
        "", "--target", help="the job's target (`torchfarm target` there); default: this machine"
    ),
    device: str = typer.Option("cpu", help="without --target: cpu or cuda, this machine's"),
    world_size: int = typer.Option(
        1,
        min=1,
        help="the job's data-parallel ranks (DDP): ENTRY runs as rank 0 of a process group "
        "of this size that communicates nothing; its dist.init_process_group call is absorbed",
    ),
    addr: str = typer.Option(None, help="[TORCHFARM_ADDR] gateway host:port"),
    token: str = typer.Option(None, help="[TORCHFARM_TOKEN] this tenant's token"),
) -> None:
    """Compile a job's graphs on the farm before its hardware exists: ENTRY runs on fake
    tensors here, and the farm compiles every graph it traces for the target's pool. The
    job's first process is then a farm hit for each. Exits 1 if a graph was not prepared or
    the step stopped early."""
    import importlib
    import os
    import sys

    from google.protobuf import json_format

    from torchfarm.client import prepare as preparation
    from torchfarm.compiler.target import local_target
    from torchfarm.proto import torchfarm_pb2 as pb

    if not (addr or env.get("ADDR")):
        typer.echo("torchfarm prepare: no farm (set TORCHFARM_ADDR or --addr)", err=True)
        raise typer.Exit(2)
    module_name, _, function = entry.partition(":")
    sys.path.insert(0, os.getcwd())  # the user's modules, as `python -m` finds them
    fn = getattr(importlib.import_module(module_name), function or "main")
    if target_file:
        with open(target_file) as f:
            job_target = json_format.Parse(f.read(), pb.Target())
    else:
        job_target = local_target(device)
    with env.override(ADDR=addr or None, TOKEN=token or None):
        summary = preparation.run(fn, job_target, world_size)
    print(summary.table())
    raise typer.Exit(1 if summary.stopped or summary.count("failed") else 0)


@app.command()
def export(
    program: str = typer.Argument(..., help="a torch.export program saved by torch.export.save"),
    output: str = typer.Option(..., "--output", "-o", help="the package to write (.pt2)"),
    target_file: str = typer.Option(
        "", "--target", help="the target (`torchfarm target` there); default: this machine"
    ),
    mode: str = typer.Option("default", help="default, max-autotune, max-autotune-no-cudagraphs"),
    config: list[str] = typer.Option(
        [], help="an Inductor config KEY=JSON_VALUE (repeatable), e.g. max_autotune=true"
    ),
    weights: bool = typer.Option(
        False, help="send the weights too (default: none sent; written into the package here)"
    ),
    addr: str = typer.Option(None, help="[TORCHFARM_ADDR] gateway host:port"),
    token: str = typer.Option(None, help="[TORCHFARM_TOKEN] this tenant's token"),
) -> None:
    """Build an AOTInductor package of PROGRAM on the farm, for the target's pool: a
    self-contained package with PROGRAM's weights, which torch's loaders run as it is. Without
    --weights they never leave this machine: the farm builds it without them and they are
    written into it here. Exits 1 if the farm gave none."""
    import json
    import time

    import torch

    from torchfarm.client import exported
    from torchfarm.compiler import aoti
    from torchfarm.errors import FarmError
    from torchfarm.settings import ClientSettings

    configs = {}
    for item in config:
        key, _, value = item.partition("=")
        try:
            configs[key] = json.loads(value)
        except ValueError:
            typer.echo(f"torchfarm export: --config {item!r}: the value is not JSON", err=True)
            raise typer.Exit(2) from None
    settings = ClientSettings.from_env(addr=addr, token=token)
    started = time.monotonic()
    try:
        loaded = torch.export.load(program)
        artifact, source = exported.package_artifact(
            loaded,
            target=target_file or None,
            mode=mode,
            inductor_configs=configs,
            weights=weights,
            settings=settings,
        )
        aoti.write_package(output, artifact, loaded)
    except (FarmError, ValueError) as e:
        typer.echo(f"torchfarm export: {e}", err=True)
        raise typer.Exit(1) from None
    size = os.path.getsize(output)
    print(f"{output}: {size / 1e6:.1f} MB, {source}, {time.monotonic() - started:.1f} s")


def main() -> None:
    app()
