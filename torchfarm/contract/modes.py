"""The compile modes torchfarm accepts: torch.compile's `mode` names."""

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
