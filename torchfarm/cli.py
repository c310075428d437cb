"""`torchfarm` command line: up (embedded farm), gateway, worker, cache, doctor, keygen, token."""

from __future__ import annotations

import signal
import threading

import typer

from torchfarm.cache.cli import app as cache_app

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
        "", envvar="TORCHFARM_TENANTS", help="tenant:sha256(token),... (empty: an open farm)"
    ),
    admins: str = typer.Option("", envvar="TORCHFARM_ADMINS", help="admin:sha256(token),..."),
) -> None:
    """Start an embedded local farm; prints TORCHFARM_ADDR=host:port once every worker has
    compiled its canary, or exits 1 with the reason (a worker's own error) instead."""
    from torchfarm.local_farm import FarmNotReady, LocalFarm

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    farm = LocalFarm(
        grpc_port=grpc_port,
        redis_port=redis_port,
        host=host,
        workers=workers,
        sandbox=sandbox,
        device=device,
        tenants=tenants,
        admins=admins,
        # Celery's queues and the job board on a redis-server of their own: a cache at its
        # memory limit then never refuses the broker's writes (which ends a Celery worker)
        separate_broker=True,
    )
    try:
        with farm:
            print(f"TORCHFARM_ADDR={farm.addr}", flush=True)
            typer.echo(
                f"redis on 127.0.0.1:{farm.redis_port} (password in {farm.workdir}/redis/"
                f"redis.conf); {'tenants' if tenants else 'OPEN farm (no TORCHFARM_TENANTS)'}; "
                f"logs in {farm.log_dir}; Ctrl-C stops the farm",
                err=True,
            )
            while not stop.wait(WORKER_CHECK_S):
                for restarted in farm.restart_exited_workers():
                    typer.echo(f"torchfarm up: worker {restarted} exited; started again", err=True)
    except FarmNotReady as e:
        typer.echo(f"torchfarm up: the farm is not ready: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo("farm stopped", err=True)


@app.command()
def gateway(
    host: str = typer.Option(None, help="[TORCHFARM_GATEWAY_HOST]"),
    port: int = typer.Option(None, help="[TORCHFARM_GATEWAY_PORT]"),
    redis_url: str = typer.Option(None, help="[TORCHFARM_REDIS_URL]"),
    log_level: str = "info",
) -> None:
    """Run the gRPC gateway."""
    from torchfarm.gateway.server import serve
    from torchfarm.settings import GatewaySettings

    _logging(log_level)
    serve(GatewaySettings.from_env(host=host, port=port, redis_url=redis_url))


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


def main() -> None:
    app()
