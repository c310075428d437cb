"""A 2-rank DDP job's first training step: local torch.compile against the farm.

DDP buckets no larger than one block make DDPOptimizer split tests/models.py's BlockMLP into
one graph per block, all handed to the backend before the first runs: the farm compiles them
in parallel, and the ranks share each compile. Each run is a fresh torchrun job with empty
local caches: (a) local torch.compile, (b) the farm's first job (an empty farm), (c) the
farm's second job. Reported: each first step (slowest rank), the worker compiles of (b) and
(c) (the farm's counters), and how far (b) and (c) are from (a) in outputs and gradients.

--model zoo:NAME runs a third-party zoo model instead (tests/zoo/models.py, its own loss and
batch, each rank the batch of its rank, bf16 autocast where the zoo's cuda scale uses it):
DDPOptimizer splits it at the same 1 MiB buckets.

Usage: python bench/ddp.py [--device cuda] [--model blocks|zoo:NAME] [--addr HOST:PORT
--redis-url URL] [--json PATH]
(it runs torchrun itself; gloo on CPU, nccl on CUDA with one GPU per rank). Without --addr
it starts an embedded farm (torchfarm.local_farm) for the device, whose workers read the
environment (e.g. TORCHFARM_WORKER_CONCURRENCY).
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from warm_start import fresh_process_env  # noqa: E402  (bench/ is this script's directory)

from tests.models import build  # noqa: E402
from torchfarm.local_farm import LocalFarm, free_port  # noqa: E402

BUCKET_CAP_MB = 1  # each block's weights are over 1 MiB (DDP's first bucket may not be larger)
AGREE = dict(rtol=1e-4, atol=1e-4)
AGREE_ZOO = dict(rtol=2e-2, atol=2e-2)  # bf16 autocast: the farm's kernels are Inductor's own


def rank_step(backend: str, device: str, model_name: str, out_dir: str) -> None:
    """One rank of a torchrun job: DDP, torch.compile, the first step, timed; writes what it
    computed and what the farm did for it to OUT_DIR/rank<N>.{pt,json}."""
    import contextlib

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchfarm.client.backend import history

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    on = torch.device(device, local_rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(on)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    autocast = contextlib.nullcontext()
    if model_name == "blocks":
        model, x = build("blocks", seed=0)  # the same weights on every rank
        args, kwargs = ((x + rank).to(on),), {}  # but each rank its own batch
        loss_of = lambda out: (out.sum(), out)  # noqa: E731
    else:
        from tests.zoo import models as zoo

        built = zoo.build(model_name.removeprefix("zoo:"), device, str(on))
        model, loss_of = built.model, built.loss
        args, kwargs = built.batch(rank, True)
        if built.autocast and device == "cuda":
            autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    ddp = DDP(
        model.to(on),
        bucket_cap_mb=BUCKET_CAP_MB,
        device_ids=[local_rank] if device == "cuda" else None,
    )
    step = torch.compile(ddp, backend=backend)
    dist.barrier()
    started = time.perf_counter()
    with autocast:
        loss, out = loss_of(step(*args, **kwargs))
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    torch.save(
        {
            "out": out.detach().float().cpu(),
            "grads": [p.grad.float().cpu() for p in ddp.parameters() if p.grad is not None],
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    waits = [r for r in history if r.deferred]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "seconds": seconds,
                "sources": [r.source for r in history],
                "keys": [r.key for r in history],
                "deferred": len(waits),
                # per graph, where its time went (the farm's MissTimings and the client's)
                "graphs": [
                    {
                        "label": r.label,
                        "source": r.source,
                        "seconds": round(r.seconds, 3),
                        "timings": r.timings,
                    }
                    for r in history
                ],
                "all_submitted_before_first_wait": bool(waits)
                and max(r.submitted for r in waits) < min(r.awaited for r in waits),
            },
            f,
        )
    dist.destroy_process_group()


def job(backend: str, args, addr: str = "") -> dict:
    """A fresh 2-rank torchrun job with empty local caches; each rank's figures and tensors."""
    out_dir = tempfile.mkdtemp(prefix=f"ddp-{backend}-")
    cache = tempfile.mkdtemp(prefix="ddp-cache-")
    env = fresh_process_env(
        cache,
        TORCHFARM_ADDR=addr,
        OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.ranks)),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={args.ranks}",
            f"--master-port={free_port()}",
            os.path.abspath(__file__),
            "--rank-step",
            backend,
            "--device",
            args.device,
            "--model",
            args.model,
            "--out-dir",
            out_dir,
        ],
        env=env,
        check=True,
    )
    ranks = []
    for rank in range(args.ranks):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            figures = json.load(f)
        figures["tensors"] = torch.load(os.path.join(out_dir, f"rank{rank}.pt"))
        ranks.append(figures)
    return {
        "seconds": max(r["seconds"] for r in ranks),
        "ranks": ranks,
        "graphs": len(ranks[0]["sources"]),
        "distinct_keys": len({k for r in ranks for k in r["keys"]}),
    }


def disagreement(job_: dict, reference: dict, model: str) -> tuple[float, bool]:
    """Largest absolute difference of outputs and gradients from the reference, every rank;
    and whether all are close (AGREE, or AGREE_ZOO for a zoo model)."""
    agree = AGREE if model == "blocks" else AGREE_ZOO
    worst, close = 0.0, True
    for mine, theirs in zip(job_["ranks"], reference["ranks"]):
        a = [mine["tensors"]["out"], *mine["tensors"]["grads"]]
        b = [theirs["tensors"]["out"], *theirs["tensors"]["grads"]]
        for u, v in zip(a, b):
            worst = max(worst, (u - v).abs().max().item())
            close = close and torch.allclose(u, v, **agree)
    return worst, close


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", default="blocks", help="blocks, or zoo:NAME")
    parser.add_argument("--addr", default="", help="a running farm (else an embedded one)")
    parser.add_argument("--redis-url", default="", help="that farm's Redis, for its counters")
    parser.add_argument("--workers", type=int, default=1, help="embedded farm's workers")
    parser.add_argument(
        "--sandbox",
        default=os.environ.get("TORCHFARM_SANDBOX", "bwrap"),
        help="embedded farm's sandbox (bwrap, or none where bwrap cannot run)",
    )
    parser.add_argument("--json", default="", help="write the figures here")
    parser.add_argument("--log-dir", default="", help="embedded farm's logs (default: its dir)")
    parser.add_argument("--rank-step", default="", help=argparse.SUPPRESS)  # set by torchrun
    parser.add_argument("--out-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_step:
        rank_step(args.rank_step, args.device, args.model, args.out_dir)
        return

    local = job("inductor", args)
    farm = (
        None
        if args.addr
        else LocalFarm(
            device=args.device,
            workers=args.workers,
            sandbox=args.sandbox,
            log_dir=args.log_dir or None,
        )
    )
    try:
        if farm is not None:
            farm.start()
        addr = args.addr or farm.addr  # type: ignore[union-attr]
        store = farm.store() if farm is not None else None
        if store is None and args.redis_url:
            from torchfarm.cache.store import Store

            store = Store.from_url(args.redis_url)

        def compiles() -> int | None:
            return int(store.counters.farm().get("compiles", 0)) if store else None

        before = compiles()
        first = job("torchfarm", args, addr)
        between = compiles()
        second = job("torchfarm", args, addr)
        after = compiles()
    finally:
        if farm is not None:
            farm.stop()

    def counted(a, b):
        return None if a is None or b is None else b - a

    first_err, first_close = disagreement(first, local, args.model)
    second_err, second_close = disagreement(second, local, args.model)
    figures = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()}, {os.cpu_count()} cores"
        + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""),
        "torch": torch.__version__,
        "device": args.device,
        "model": args.model,
        "ranks": args.ranks,
        "graphs_per_rank": first["graphs"],
        "local_first_step_s": round(local["seconds"], 2),
        "farm_first_job_s": round(first["seconds"], 2),
        "farm_first_job_sources": [r["sources"] for r in first["ranks"]],
        "farm_first_job_graphs": [r["graphs"] for r in first["ranks"]],
        "farm_first_job_all_submitted_before_first_wait": all(
            r["all_submitted_before_first_wait"] for r in first["ranks"]
        ),
        "distinct_graphs": first["distinct_keys"],
        "worker_compiles_first_job": counted(before, between),
        "farm_second_job_s": round(second["seconds"], 2),
        "farm_second_job_sources": [r["sources"] for r in second["ranks"]],
        "worker_compiles_second_job": counted(between, after),
        "farm_first_vs_local_max_abs": first_err,
        "farm_first_agrees_with_local": first_close,
        "farm_second_vs_local_max_abs": second_err,
        "farm_second_agrees_with_local": second_close,
    }
    print(
        f"DDP bench, {figures['date']}, {figures['machine']}, torch {figures['torch']}, "
        f"{args.model}, {args.ranks} ranks on {args.device}, {figures['graphs_per_rank']} graphs "
        "per rank"
    )
    print(f"local torch.compile, first step        {local['seconds']:8.2f} s")
    print(
        f"farm first job (empty farm), first step {first['seconds']:8.2f} s   "
        f"({first['seconds'] / local['seconds']:.2f}x local)"
    )
    print(f"  sources per rank {figures['farm_first_job_sources']}")
    print(
        f"  worker compiles {figures['worker_compiles_first_job']} for "
        f"{figures['distinct_graphs']} distinct graphs; all submitted before the first wait: "
        f"{figures['farm_first_job_all_submitted_before_first_wait']}"
    )
    print(
        f"farm second job, first step             {second['seconds']:8.2f} s   "
        f"({second['seconds'] / local['seconds']:.2f}x local)"
    )
    print(f"  sources per rank {figures['farm_second_job_sources']}")
    print(f"  worker compiles {figures['worker_compiles_second_job']}")
    print(
        f"agreement with local torch.compile (outputs and gradients, every rank): first job "
        f"max abs {first_err:.2e} ({'ok' if first_close else 'DIFFERS'}), second job "
        f"max abs {second_err:.2e} ({'ok' if second_close else 'DIFFERS'})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
