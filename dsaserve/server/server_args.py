"""ServerArgs: the HTTP side's settings, built once by `dsaserve serve` and passed down (startup chain input).

Owns: host/port, the optional API key, the admission bound, request-size and timeout limits, and the
engine arguments (EngineArgs, as a plain dict so it can cross into the scheduler process as JSON).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ServerArgs:
    model_dir: str  # resolved checkpoint directory (tokenizer + weights)
    served_model_name: str
    engine_args: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # samples accepted beyond max_running_requests before 429 (None: unbounded)
    max_queued_requests: int | None = 1024
    max_request_bytes: int = 8 << 20  # request bodies above this get 413 (a 1M-token JSON prompt is ~5 MB)
    health_timeout_s: float = 20.0  # /health's 1-token probe must come back within this
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    startup_timeout_s: float | None = None  # None: wait for the scheduler as long as it takes
    log_level: str = "info"
    manifest_json: str | None = None  # write the startup manifest here once Up

    def __post_init__(self) -> None:
        if not (0 < self.port < 65536):
            raise ValueError(f"--port: {self.port} is not a TCP port")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests: must be >= 0, got {self.max_queued_requests}")
        if self.max_request_bytes <= 0:
            raise ValueError(f"--max-request-bytes: must be positive, got {self.max_request_bytes}")
        for name in ("health_timeout_s", "drain_timeout_s", "startup_timeout_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_s', '').replace('_', '-')}: must be positive")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key: must not be empty")
