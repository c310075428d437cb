"""Why AOTAutograd did not cache a graph (a CompiledArtifact is saved from that cache).

Listens to the logger of torch._functorch._aot_autograd.autograd_cache (a private module
name) for its "Bypassing" / "unable to" lines. Verified: torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

import logging


class AutogradCacheLog(logging.Handler):
    """Collects why AOTAutograd bypassed its cache while entered."""

    _LOGGER = "torch._functorch._aot_autograd.autograd_cache"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Bypassing" in message or "unable to" in message:
            self.messages.append(message[:2000])

    def __enter__(self) -> AutogradCacheLog:
        logger = logging.getLogger(self._LOGGER)
        self._saved_level = logger.level
        logger.addHandler(self)
        logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger(self._LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self._saved_level)
