"""The compile modes torchfarm accepts: torch.compile's `mode` names."""

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DEFAULT = MODES[0]  # what an empty Options.mode means


def named(mode: str | None) -> str:
    """`mode` by its name: "" is the default."""
    return mode or DEFAULT


def checked(mode: str | None) -> str:
    """`named(mode)`, or ValueError for a mode torchfarm does not accept."""
    if named(mode) not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
    return named(mode)
