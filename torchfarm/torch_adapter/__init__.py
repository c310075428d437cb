"""Every use of a private torch name, in one place: one module per patch or private use.

Each module's docstring names what it uses or replaces and the torch releases it was
verified on; `gate` lists those releases. Importing the package runs the gate
(`UNVERIFIED`: the reason not to use the farm with the installed torch, or None); the
client then compiles locally and the worker refuses to start. compiler/* keep the farm's
own logic and reach torch internals only through these modules.

Grouped by purpose, each subpackage's docstring a map of its modules:
- trace/    the graph as Dynamo traced it, and as it travels (client, compiler/serialize)
- compile/  Inductor's compile of a graph, and the hooks into it (compiler, compile child)
- load/     loading an artifact and running it as locally compiled (client, compiler)
- worker/   what only the worker's processes use: toolchain, kernel builds, the GPU
- gate      the torch releases all of these were verified on
Imports point down only: worker/ may use compile/ and load/; those and trace/ only gate.
"""

from torchfarm.torch_adapter import gate

UNVERIFIED: str | None = gate.unverified()
