"""`python -m torchfarm`: the CLI, run with the working directory off sys.path.

`python -m` puts the working directory first on sys.path. Started from a checkout's parent
directory, the repository root there shadows the package (as a namespace package with no
`__file__`), and whatever else lies there becomes importable by the farm's processes. So
the CLI first re-executes itself without it: `python -P` on 3.11+, the same by hand on 3.10.
On 3.11+ the interpreter's own flag decides, so a working directory that no longer exists
(os.getcwd() raises) starts the CLI too.
"""

import os
import sys


def _working_directory_on_path() -> bool:
    if sys.version_info >= (3, 11):
        return not sys.flags.safe_path
    try:
        cwd = os.getcwd()
    except OSError:  # deleted: nothing there to import
        return bool(sys.path) and sys.path[0] == ""
    return bool(sys.path) and sys.path[0] in ("", cwd)


if _working_directory_on_path():
    if sys.version_info >= (3, 11):
        argv = [sys.executable, "-P", "-m", "torchfarm"]
    else:  # -c puts "" first, which it drops before importing the CLI
        argv = [
            sys.executable,
            "-c",
            "import sys; del sys.path[0]; from torchfarm.cli import main; main()",
        ]
    os.execv(sys.executable, argv + sys.argv[1:])

from torchfarm.cli import main  # noqa: E402

main()
