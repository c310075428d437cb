"""`make demo`: start an embedded farm, run examples/train.py twice in fresh processes with
empty local Inductor caches, and report where each compile came from."""

import json
import os
import subprocess
import sys
import tempfile

from torchfarm.local_farm import LocalFarm

HERE = os.path.dirname(os.path.abspath(__file__))


def run_client(addr: str) -> dict:
    env = dict(
        os.environ,
        TORCHFARM_ADDR=addr,
        TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(),
        TRITON_CACHE_DIR=tempfile.mkdtemp(),
    )
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "train.py")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    print("starting the embedded farm (redis-server, gateway, CPU worker) ...", flush=True)
    with LocalFarm() as farm:
        print(f"farm ready at {farm.addr}\n", flush=True)
        rows = []
        for run in ("first process", "second process"):
            result = run_client(farm.addr)
            rows.append(
                (
                    run,
                    ", ".join(sorted(set(result["sources"]))),
                    f"{result['first_step_s']:.2f} s",
                    "yes"
                    if result["matches_eager"]
                    else f"NO (loss err {result['max_loss_err']:.2g})",
                )
            )
    widths = [
        max(
            len(r[i])
            for r in rows + [("run", "compile source", "time to first step", "matches eager")]
        )
        for i in range(4)
    ]
    for row in [("run", "compile source", "time to first step", "matches eager")] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    if not all(r[3] == "yes" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
