"""Inductor's vector-ISA probe, run as a worker runs it (it builds test programs with g++),
and a child's warm-up answered from it."""

import json
import os
import subprocess
import sys

import pytest

from torchfarm.torch_adapter.worker import isa_probe

pytestmark = pytest.mark.integration

# A child's ISA pick, counting the build checks that really build.
_PICK = """
import json, sys
from torch._inductor import cpu_vec_isa
from torchfarm.torch_adapter.worker import isa_probe
built = []
build = cpu_vec_isa.VecISA.check_build
cpu_vec_isa.VecISA.check_build = lambda isa, code: built.append(str(isa)) or build(isa, code)
with isa_probe.vouched_checks(sys.argv[1]):
    picked = str(cpu_vec_isa.pick_vec_isa())
print(json.dumps({"picked": picked, "built": built}))
"""


def _pick(tmp_path, agreement: str = "") -> dict:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        **isa_probe.TRUST_FLAGS_ENV,
    }
    out = subprocess.run(
        [sys.executable, "-c", _PICK, agreement],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_probe_agrees_and_a_child_answered_from_it_builds_nothing(tmp_path):
    # Inductor's own probe (it builds test programs) and the CPU flags give the same ISAs here;
    # where they do not, children keep probing, which costs time, never correctness.
    checks = isa_probe.children_may_trust_flags()
    assert checks, checks
    assert "TORCHINDUCTOR_VEC_ISA_OK" not in os.environ
    flags_only = _pick(tmp_path / "a")
    vouched = _pick(tmp_path / "b", json.dumps(checks))
    assert vouched == {"picked": flags_only["picked"], "built": []}
    print("build checks a child ran on the flags alone:", flags_only["built"])
