"""Every use of a private torch name, in one place: one module per patch or private use.

Each module's docstring names what it uses or replaces and the torch releases it was
verified on; `gate` lists those releases. Importing the package runs the gate
(`UNVERIFIED`: the reason not to use the farm with the installed torch, or None); the
client then compiles locally and the worker refuses to start. compiler/* keep the farm's
own logic and reach torch internals only through these modules.
"""

from torchfarm.torch_adapter import gate

UNVERIFIED: str | None = gate.unverified()
