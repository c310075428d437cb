"""Log lines of the farm's processes (gateway, worker): plain text, or with
TORCHFARM_LOG_FORMAT=json one JSON object per line. Either way, a line about one request
carries its request id (`extra={"request_id": ...}`: the id the client sent as
x-request-id), and a line about one compile its job id (`job_id`: the Job.job_id the gateway
assigns, which the worker logs and the client hears in the compile's progress and header)."""

from __future__ import annotations

import json
import logging

from torchfarm.settings import env

FIELDS = ("request_id", "job_id", "tenant", "key", "pool")  # `extra` fields a line may carry


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message [request ID job ID]`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = " ".join(
            f"{name} {value}"
            for name, field in (("request", "request_id"), ("job", "job_id"))
            if (value := getattr(record, field, ""))
        )
        return f"{line} [{ids}]" if ids else line


class JsonFormatter(logging.Formatter):
    """One object per line: ts, level, logger, message, the FIELDS present, exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({f: getattr(record, f) for f in FIELDS if getattr(record, f, "")})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup(level: str, fmt: str | None = None) -> None:
    """Configure the root logger: `fmt` text or json (default TORCHFARM_LOG_FORMAT, text)."""
    fmt = (fmt or env.raw("LOG_FORMAT") or env.default("LOG_FORMAT")).lower()
    env.check("LOG_FORMAT", fmt)
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
