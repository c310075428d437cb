"""Run Inductor's cudagraph post-compile step when an artifact loads.

`CompiledArtifact.load` passes `cudagraphs=BoxedBool(False)` to the post-compile of the
graph it loads (`GenericAOTAutogradResult.wrap_post_compile`); the artifact was compiled
with `triton.cudagraphs` on, so it carries what cudagraph trees need. While
`cudagraphs_on_load` is entered, that one call gets a `cudagraphs` flag that is on (one
BoxedBool shared by forward and backward, as the loader's is); nothing else changes.
No public parameter carries the flag (CompiledArtifact.load takes only a path and a format).

Uses torch._functorch._aot_autograd.aot_autograd_result.GenericAOTAutogradResult
.wrap_post_compile and torch._inductor.utils.BoxedBool.
Verified: torch 2.11.0, 2.13.0, 2.15.0 (same signature: args, aot_config, fx_config).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch._functorch._aot_autograd.aot_autograd_result import GenericAOTAutogradResult
from torch._inductor import config as inductor_config
from torch._inductor.utils import BoxedBool


@contextlib.contextmanager
def cudagraphs_on_load(enabled: bool) -> Iterator[None]:
    """Make the load inside the block wrap the loaded code in cudagraph trees if `enabled`."""
    if not enabled:
        yield
        return
    original = GenericAOTAutogradResult.wrap_post_compile

    def with_cudagraphs(self, args, aot_config, fx_config):
        return original(self, args, aot_config, {**fx_config, "cudagraphs": BoxedBool(True)})

    setattr(GenericAOTAutogradResult, "wrap_post_compile", with_cudagraphs)  # noqa: B010
    try:
        with inductor_config.patch({"triton.cudagraphs": True}):
            yield
    finally:
        setattr(GenericAOTAutogradResult, "wrap_post_compile", original)  # noqa: B010
