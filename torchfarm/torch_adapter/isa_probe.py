"""Inductor's CPU vector-ISA probe, run once per toolchain instead of once per compile.

On first use of a cache dir, Inductor checks each vector ISA the CPU's flags advertise by
building and loading a test program (`cpu_vec_isa.VecISA.check_build`): about 8 s of every
compile on the 2-core machine, since a compile child always starts in a fresh cache dir. The
worker runs the probe once, in a subprocess with a throwaway cache dir. Where it accepts
exactly the ISAs the flags list, the children may trust the flags
(`TORCHINDUCTOR_VEC_ISA_OK=1`, read into `config.cpp.vec_isa_ok`) and pick the same ISA
without building anything; otherwise they keep probing. The probe runs in the background
while the worker starts (workers/toolchain.py), so the first compiles may still probe for
themselves. An agreement is kept beside the toolchain's precompiled headers (the same key:
torch build, compiler, CPU, interpreter), so the next worker of that toolchain, a restarted
one included, vouches at once and its canary and first children probe nothing (~12 CPU
seconds of the 2-core machine for the probe, ~8 more in each child that would start before
it). A disagreement is not kept: every worker probes again, which costs time, never
correctness.

Uses `torch._inductor.cpu_vec_isa.valid_vec_isa_list` (functools.cache'd) and
`torch._inductor.config.cpp.vec_isa_ok`. Verified: torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

TRUST_FLAGS_ENV = {"TORCHINDUCTOR_VEC_ISA_OK": "1"}
# Set in the worker's main process before Celery forks its pool: where the probe's verdict
# appears once it is in.
_MARKER_ENV = "TORCHFARM_ISA_PROBE_MARKER"

_PROBE = """
import json
from torch._inductor import config, cpu_vec_isa
built = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
cpu_vec_isa.valid_vec_isa_list.cache_clear()
config.cpp.vec_isa_ok = True
flagged = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
print(json.dumps({"built": built, "flagged": flagged}))
"""


def children_may_trust_flags(timeout_s: float = 300) -> bool:
    """Run the probe once; True if its result equals what the CPU flags alone give."""
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
        return False
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return bool(found["built"]) and found["built"] == found["flagged"]


def declare() -> str:
    """Worker main process, before its pool forks: where the probe's verdict will appear."""
    marker = os.path.join(tempfile.mkdtemp(prefix="torchfarm-isa-"), "children-may-trust-flags")
    os.environ[_MARKER_ENV] = marker
    return marker


def recall(marker: str, kept: str) -> bool:
    """Worker main process, at once: True (and the children trust the flags from now on) if
    an earlier worker of this toolchain kept an agreement at `kept`."""
    if not os.path.exists(kept):
        return False
    open(marker, "w").close()
    return True


def settle(marker: str, kept: str) -> None:
    """Probe once (off the start-up path); let the children trust the flags if it agreed, and
    keep the agreement at `kept` for the next worker of this toolchain."""
    if children_may_trust_flags():
        open(marker, "w").close()
        try:
            open(kept, "w").close()
        except OSError:  # a store that cannot be written: the next worker probes again
            pass


def child_environment() -> dict[str, str]:
    """What a compile child's environment gains from the probe (nothing until it is in)."""
    marker = os.environ.get(_MARKER_ENV, "")
    return dict(TRUST_FLAGS_ENV) if marker and os.path.exists(marker) else {}
