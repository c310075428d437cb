"""Inductor's CPU vector-ISA probe, run once per toolchain instead of once per compile.

On first use of a cache dir, Inductor checks each vector ISA the CPU's flags advertise by
building and loading a test program (`cpu_vec_isa.VecISA.check_build`): about 8 s of every
compile on the 2-core machine, since a compile child always starts in a fresh cache dir. The
worker runs the probe once, in a subprocess with a throwaway cache dir. Where it accepts
exactly the ISAs the flags list, the children may trust the flags
(`TORCHINDUCTOR_VEC_ISA_OK=1`, read into `config.cpp.vec_isa_ok`) and pick the same ISA
without building anything; otherwise they keep probing. How the verdict reaches the children,
and is kept for the next worker of the toolchain: workers/isa_verdict.py.

The flags do not settle everything: on a CPU with AVX-512, Inductor's AVX512, AVX512-VNNI and
AMX classes also build bf16, VNNI and AMX test programs whatever `vec_isa_ok` says (6 g++
check builds in each child's warm-up on the 2-core machine). The probe records every such
`VecISA.check_build` it ran, by what determines it (the ISA class, its build flags and the
test program's source), and the agreement carries them: a child answers the same checks
from it (`vouched_checks`) instead of building them again, and builds any other.

Uses `torch._inductor.cpu_vec_isa.valid_vec_isa_list` (functools.cache'd), `pick_vec_isa`,
`VecISA.check_build(code)` and `torch._inductor.config.cpp.vec_isa_ok`. Verified: torch
2.11.0, 2.13.0, 2.15.0 (`make test-versions` runs this module's tests on each release).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

TRUST_FLAGS_ENV = {"TORCHINDUCTOR_VEC_ISA_OK": "1"}

_PROBE = """
import json
from torch._inductor import config, cpu_vec_isa
from torchfarm.torch_adapter.worker.isa_probe import check_fingerprint
checks = {}
build = cpu_vec_isa.VecISA.check_build
def recorded(isa, code):
    checks[check_fingerprint(isa, code)] = ok = build(isa, code)
    return ok
cpu_vec_isa.VecISA.check_build = recorded
built = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
cpu_vec_isa.valid_vec_isa_list.cache_clear()
config.cpp.vec_isa_ok = True
flagged = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
print(json.dumps({"built": built, "flagged": flagged, "checks": checks}))
"""


def check_fingerprint(isa, code: str) -> str:
    """What determines a `VecISA.check_build(code)` on one toolchain: the ISA's class, the
    flags it builds with, and the test program."""
    what = f"{type(isa).__name__}\0{isa.build_arch_flags()}\0{code}"
    return hashlib.sha256(what.encode()).hexdigest()


def children_may_trust_flags(timeout_s: float = 300) -> dict[str, bool] | None:
    """Run the probe once: the build checks it ran (fingerprint -> result) if its result
    equals what the CPU flags alone give, else None."""
    cache_dir = tempfile.mkdtemp(prefix="torchfarm-isa-probe-")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
    env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE],
            env=env,
            cwd=cache_dir,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        ).stdout
        found = json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    agreed = bool(found["built"]) and found["built"] == found["flagged"]
    return {str(k): bool(v) for k, v in found["checks"].items()} if agreed else None


@contextlib.contextmanager
def vouched_checks(agreement: str) -> Iterator[None]:
    """Inside (a child's warm-up): each ISA build check that the worker's probe ran (its
    `agreement`, from workers/isa_verdict.child_arguments) is answered with its result instead
    of built again; any other is built as usual."""
    try:
        checks = json.loads(agreement or "{}")
    except ValueError:  # an agreement kept by an older worker: no checks in it
        checks = {}
    from torch._inductor import cpu_vec_isa

    build = cpu_vec_isa.VecISA.check_build
    if not isinstance(checks, dict) or not checks:
        yield
        return

    def answered(isa, code: str) -> bool:
        found = checks.get(check_fingerprint(isa, code))
        return build(isa, code) if found is None else bool(found)

    cpu_vec_isa.VecISA.check_build = answered  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        cpu_vec_isa.VecISA.check_build = build  # type: ignore[method-assign]


def pick(agreement: str) -> None:
    """A child's warm-up: Inductor's ISA pick (instant where the worker's probe vouched, its
    `agreement`), remembered in-process; its test programs go to a directory removed at once,
    so the request finds an empty home."""
    from torch._inductor import cpu_vec_isa

    from torchfarm.torch_adapter.compile import standalone

    with (
        tempfile.TemporaryDirectory() as probe_dir,
        standalone.cache_dir_at(probe_dir),
        vouched_checks(agreement),
    ):
        cpu_vec_isa.pick_vec_isa()
