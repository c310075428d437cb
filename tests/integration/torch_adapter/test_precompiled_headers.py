"""The precompiled headers' dir is where this torch's Inductor looks for them, asked of a
fresh interpreter (the binds and flags: tests/unit/torch_adapter/)."""

import os
import subprocess
import sys

from torchfarm.torch_adapter.worker import precompiled_headers


def test_the_header_dir_is_where_this_torch_looks(tmp_path):
    code = "from torch._inductor import codecache; print(codecache._HEADER_DIR)"
    env = dict(os.environ, TMPDIR=str(tmp_path), USER="somebody")
    found = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    assert found == precompiled_headers.header_dir(str(tmp_path), "somebody")
