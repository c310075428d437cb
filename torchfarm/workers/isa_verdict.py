"""The vector-ISA probe's verdict, from the worker's main process to its compile children.

The worker runs Inductor's ISA probe once (torch_adapter/worker/isa_probe.py says why), in
the background while it starts (workers/toolchain.py), so the first compiles may still probe
for themselves. The main process declares a marker file before its pool forks
(TORCHFARM_ISA_PROBE_MARKER); until the probe agreed with the CPU flags it stays absent and a
child gets nothing; after, a child's environment trusts the flags and its command line
carries the build checks the probe ran. An agreement is kept beside the toolchain's
precompiled headers (the same key: torch build, compiler, CPU, interpreter), so the next
worker of that toolchain, a restarted one included, vouches at once and its canary and first
children probe nothing (~12 CPU seconds of the 2-core machine for the probe, ~8 more in each
child that would start before it). A disagreement is not kept: every worker probes again,
which costs time, never correctness.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

from torchfarm.settings import env
from torchfarm.torch_adapter.worker import isa_probe

CHECKS_ARGUMENT = "--isa-checks"  # a child's: the probe's check_build results (JSON)


def declare() -> str:
    """Worker main process, before its pool forks: where the probe's verdict will appear."""
    marker = os.path.join(tempfile.mkdtemp(prefix="torchfarm-isa-"), "children-may-trust-flags")
    env.export(ISA_PROBE_MARKER=marker)  # for the pool Celery forks
    return marker


def recall(marker: str, kept: str) -> bool:
    """Worker main process, at once: True (and the children trust the flags from now on) if
    an earlier worker of this toolchain kept an agreement at `kept` (an empty one, kept by
    an older release without the checks, is probed again)."""
    if not os.path.exists(kept) or not os.path.getsize(kept):
        return False
    shutil.copyfile(kept, marker)
    return True


def settle(marker: str, kept: str) -> None:
    """Probe once (off the start-up path); let the children trust the flags if it agreed, and
    keep the agreement at `kept` for the next worker of this toolchain."""
    checks = isa_probe.children_may_trust_flags()
    if checks is None:
        return
    with open(marker, "w") as f:
        json.dump(checks, f)
    with contextlib.suppress(OSError):  # a store that cannot be written: the next one probes
        shutil.copyfile(marker, kept)


def _agreement() -> str | None:
    """The probe's agreement as the marker holds it (None: not in, or it disagreed)."""
    marker = env.get("ISA_PROBE_MARKER")
    if not marker or not os.path.exists(marker):
        return None
    with open(marker) as f:
        return f.read()


def child_environment() -> dict[str, str]:
    """What a compile child's environment gains from the probe (nothing until it is in)."""
    return dict(isa_probe.TRUST_FLAGS_ENV) if _agreement() is not None else {}


def child_arguments() -> list[str]:
    """What a child's command line gains from the probe: the build checks it ran (on the
    command line, not in the environment, which carries nothing of the farm's)."""
    agreement = _agreement()
    return [CHECKS_ARGUMENT, agreement] if agreement else []
