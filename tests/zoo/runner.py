"""The zoo's runner: each model in two fresh processes against one farm (the first traces,
compiles through the farm and saves Dynamo's package; the second restores it), the table of
the rows, and their JSON.

    python -m tests.zoo.runner [--models a,b,...] [--json FILE]      (`make zoo`)

starts an embedded farm (real redis-server, gateway, Celery worker, Inductor in its sandbox)
for this interpreter's torch and runs every model whose library imports here; the others are
reported unavailable. The pytest tier (tests/integration/test_zoo.py) runs `run_model` on the
tier's farm.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLIENT = os.path.join(ROOT, "tests", "zoo", "client.py")
ENTRIES = ("native", "skip")
PROCESSES = ("first", "second")


@functools.cache
def _shared_dirs() -> tuple[str, str]:
    """The inductor reference's local cache, shared by every process of this run, and the
    secret both processes seal and open Dynamo's packages with."""
    return tempfile.mkdtemp(prefix="zoo-inductor-"), secrets.token_hex(32)


def run_process(farm, name: str, token: str) -> dict:
    """One fresh process of tests/zoo/client.py (a fork of the warm parent where it can be),
    its own empty local caches: its JSON result, or the error that ended it."""
    from tests.integration.helpers import run_python

    inductor_cache, package_key = _shared_dirs()
    with tempfile.TemporaryDirectory(prefix="zoo-client-") as caches:
        env = dict(
            os.environ,
            TORCHFARM_ADDR=farm.addr,
            TORCHFARM_TOKEN=token,
            TORCHFARM_SKIP_TRACING="1",
            TORCHFARM_PACKAGE_KEY=package_key,
            TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
            TRITON_CACHE_DIR=os.path.join(caches, "triton"),
        )
        try:
            returncode, stdout, stderr = run_python([CLIENT, name, inductor_cache], env, 1200)
        except subprocess.TimeoutExpired as e:  # a row of its own, not the end of the run
            return {"model": name, "crashed": f"timed out after {e.timeout:.0f} s"}
    try:
        return json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"model": name, "crashed": f"exit status {returncode}: {stderr[-3000:]}"}


def run_model(farm, name: str, token: str) -> dict:
    """Both processes of `name`, one after the other: {"first": ..., "second": ...}."""
    return {process: run_process(farm, name, token) for process in PROCESSES}


def problems(result: dict, entry: str) -> list[str]:
    """What is wrong with one entry point's rows of a model (both processes): an exception, a
    step off eager and off inductor's, a graph or recompile beyond inductor's in the same
    process; in the process that restores, a package left out or a first step that traced
    (the skip hit paid Dynamo's tracing). Empty when the rows are clean. Printed, not
    failures: a graph compiled locally because the farm could not take it (`local`: the
    program runs as under torch.compile), and inductor's own steps off eager (`ind off`)."""
    found = []
    for process in PROCESSES:
        run = result[process]
        if run.get("crashed"):
            found.append(f"{process} process crashed: {run['crashed']}")
            continue
        farm, inductor = run["variants"][entry], run["variants"]["inductor"]
        for variant, row in (("inductor", inductor), (entry, farm)):
            if row["exception"]:
                found.append(f"{process}: {variant} raised {row['exception']}")
        if farm.get("wrong"):
            found.append(f"{process}: {entry} off eager and inductor at {farm['wrong'][:3]}")
        if farm["stopped"]:  # more graphs than inductor's: the loop was cut short
            found.append(
                f"{process}: {entry} stopped: {farm['stopped']} (inductor: "
                f"{inductor['graphs']}; {farm['recompile_reasons'][:1]})"
            )
        skip = _skip_state(farm["package_log"])
        if process == "second" and skip == "left out":  # every frame traced in each process
            found.append(f"second: {entry}'s package was left out ({farm['package_log'][-1:]})")
        if process == "second" and skip == "restored" and farm.get("first_step_graphs"):
            found.append(
                f"second: {entry} restored its package and traced {farm['first_step_graphs']} "
                "graphs in the first step"
            )
        for count in ("graphs", "recompiles"):
            if farm[count] > inductor[count]:
                found.append(
                    f"{process}: {farm[count]} {count} against inductor's {inductor[count]} "
                    f"({farm['recompile_reasons'][:1]})"
                )
    return found


def _skip_state(package_log: list[str]) -> str:
    """What the skip did in a process, through either entry point: restored Dynamo's package,
    saved one, left it out (no graph's frame could be saved: later processes compile without
    the skip), or nothing (a release outside dynamo_package.VERIFIED: traced as always)."""
    for word in ("restored", "saved", "left out"):
        if any(f": {word}" in line for line in package_log):
            return word
    if any("PackageLeftOut" in line for line in package_log):
        return "left out"
    return "off" if not package_log else "failed"


def _bracketed_ratio(run: dict, entry: str) -> float | None:
    """The farm's steady step over inductor's, thread CPU time, inductor's taken as the mean
    of its run before the farm's variants and its run after them (the client's
    ZOO_STEADY_ROUNDS), so that a drift over the process favours no variant."""
    farm = run["variants"][entry].get("steady_cpu_ms")
    before, after = (run["variants"].get(v, {}).get("steady_cpu_ms") for v in INDUCTOR_RUNS)
    return round(farm / ((before + after) / 2), 3) if farm and before and after else None


INDUCTOR_RUNS = ("inductor", "inductor_again")


def _alternating_ratio(alternating: dict) -> float | None:
    """The farm's steady step over inductor's, thread CPU time, from the client's alternating
    phase (ZOO_STEADY_ROUNDS); None where it did not run or timed the farm's code twice."""
    if not alternating.get("valid") or not alternating.get("inductor_cpu_ms"):
        return None
    return round(alternating["farm_cpu_ms"] / alternating["inductor_cpu_ms"], 3)


def rows(results: dict[str, dict]) -> list[dict]:
    """One row per model, entry point and process (or one per unavailable model)."""
    table = []
    for name, result in results.items():
        first = result["first"]
        if first.get("unavailable"):
            table.append(
                {"model": name, "torch": first["torch"], "unavailable": first["unavailable"]}
            )
            continue
        for entry in ENTRIES:
            for process in PROCESSES:
                run = result[process]
                if run.get("crashed"):
                    table.append({"model": name, "entry": entry, "process": process, "crashed": 1})
                    continue
                farm, inductor = run["variants"][entry], run["variants"]["inductor"]
                ratio = farm.get("steady_ms", 0) / max(inductor.get("steady_ms", 0), 1e-9)
                alternating = farm.get("alternating") or {}
                table.append(
                    {
                        "model": name,
                        "torch": run["torch"],
                        "entry": entry,
                        "process": process,
                        "exception": farm["exception"],
                        "wrong_steps": len(farm.get("wrong", [])),
                        "inductor_off_eager": len(inductor.get("wrong", [])),
                        "max_err": farm.get("max_err"),
                        "graphs": farm["graphs"],
                        "first_step_graphs": farm.get("first_step_graphs"),
                        "inductor_graphs": inductor["graphs"],
                        "recompiles": farm["recompiles"],
                        "inductor_recompiles": inductor["recompiles"],
                        "steady_ms": farm.get("steady_ms"),
                        "inductor_ms": inductor.get("steady_ms"),
                        "eager_ms": run["eager_ms"],
                        "ratio": round(ratio, 3) if farm.get("steady_ms") else None,
                        "alternating": alternating,
                        "aba_ratio": _bracketed_ratio(run, entry),
                        "abba_ratio": _alternating_ratio(alternating),
                        "guard_us": farm["identity_guard"]["us_per_call"],
                        "guard_calls": farm["identity_guard"]["calls"],
                        "guard_first_us": farm["identity_guard"].get("first_us"),
                        "sources": farm["sources"],
                        "local": len(farm["not_farm"]),
                        "not_farm": farm["not_farm"],
                        "package": farm["package_log"][-2:],
                        "skip": _skip_state(farm["package_log"]),
                        "problems": problems(result, entry),
                    }
                )
    return table


def table(table_rows: list[dict]) -> str:
    """The printed table: one line per row, then the steady-step ratios' median."""
    head = (
        f"{'model':<20}{'entry':<7}{'proc':<7}{'exc':>4}{'wrong':>6}{'ind off':>8}{'graphs':>8}"
        f"{'1st':>4}{'recomp':>8}{'local':>6}{'farm ms':>9}{'ind ms':>8}{'ratio':>7}{'aba':>6}"
        f"{'abba':>6}{'guard us':>9}"
        f"  {'skip':<9}torch"
    )
    lines = [head, "-" * len(head)]
    for r in table_rows:
        if "unavailable" in r:
            lines.append(f"{r['model']:<20}unavailable: {r['unavailable']}")
            continue
        if "crashed" in r:
            lines.append(f"{r['model']:<20}{r['entry']:<7}{r['process']:<7}crashed")
            continue
        guard = "-" if r["guard_us"] is None else f"{r['guard_us']:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        aba, abba = (
            "-" if r.get(k) is None else f"{r[k]:.2f}" for k in ("aba_ratio", "abba_ratio")
        )
        lines.append(
            f"{r['model']:<20}{r['entry']:<7}{r['process']:<7}{int(bool(r['exception'])):>4}"
            f"{r['wrong_steps']:>6}{r['inductor_off_eager']:>8}{r['graphs']:>4}/{r['inductor_graphs']:<3}"
            f"{'-' if r['first_step_graphs'] is None else r['first_step_graphs']:>4}"
            f"{r['recompiles']:>4}/{r['inductor_recompiles']:<3}{r['local']:>6}"
            f"{'-' if r['steady_ms'] is None else format(r['steady_ms'], '.2f'):>9}"
            f"{r['inductor_ms'] or 0:>8.2f}{ratio:>7}{aba:>6}{abba:>6}{guard:>9}"
            f"  {r['skip'] or '-':<9}{r['torch']}"
        )
    for what, key in (
        ("steps 5-12, wall", "ratio"),
        ("aba: inductor before and after, CPU", "aba_ratio"),
        ("abba: alternating steps, CPU", "abba_ratio"),
    ):
        ratios = [r[key] for r in table_rows if r.get(key)]
        if ratios:
            lines.append(
                f"steady step farm/inductor ({what}): median {statistics.median(ratios):.2f}, "
                f"max {max(ratios):.2f} over {len(ratios)} rows (targets: 1.05, 1.2)"
            )
    return "\n".join(lines)


def main() -> None:
    from tests.integration.helpers import TEST_FARM_DEFAULTS, TOKENS, session_farm
    from tests.zoo import models

    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(models.NAMES))
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    for key, value in TEST_FARM_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("ZOO_STEADY_ROUNDS", "200")  # the bench's steady step (client.py)
    names = args.models.split(",")
    unavailable = {n: models.unavailable(n) for n in names}
    results = {}
    with session_farm() as farm:
        for name in names:
            if unavailable[name]:
                import torch

                row = {"unavailable": unavailable[name], "torch": torch.__version__}
                results[name] = {"first": row, "second": row}
            else:
                results[name] = run_model(farm, name, TOKENS["alice"])
            print(f"{name}: done", file=sys.stderr, flush=True)
            if args.json:  # after every model: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"rows": rows(results), "results": results}, f, indent=1)
    print(table(rows(results)))


if __name__ == "__main__":
    main()
