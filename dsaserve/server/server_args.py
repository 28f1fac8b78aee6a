"""ServerArgs: the HTTP side's settings, built once by `dsaserve serve` and passed down (startup chain input).

Owns: host/port, the tool-call and reasoning parsers (`--tool-call-parser`, `--reasoning-parser`), the
optional API key (`--api-key`, else the `DSASERVE_API_KEY` environment variable, as
vLLM reads `VLLM_API_KEY`), the admission bound, request-size and timeout limits, and the engine
arguments (EngineArgs, as a plain dict so it can cross into the scheduler process as JSON); the server
flags of `dsaserve serve` (`add_cli_args`, `from_cli_args`) and the help formatter that shows a default
only where it says something.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import socket
from dataclasses import dataclass, field
from typing import Any

from dsaserve.common import envs
from dsaserve.server.parser_names import REASONING_PARSER_CHOICES, TOOL_PARSER_CHOICES

API_KEY_ENV = "DSASERVE_API_KEY"  # vLLM: VLLM_API_KEY


@dataclass(frozen=True)
class ServerArgs:
    model_dir: str  # resolved checkpoint directory (tokenizer + weights)
    served_model_name: str
    engine_args: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # samples accepted beyond what can run at once (rows and KV pages) before 429 (None: unbounded)
    max_queued_requests: int | None = 1024
    max_request_bytes: int = 8 << 20  # request bodies above this get 413 (a 1M-token JSON prompt is ~5 MB)
    health_timeout_s: float = 20.0  # /health's 1-token probe must come back within this
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    startup_timeout_s: float | None = None  # None: wait for the scheduler as long as it takes
    log_level: str = "info"
    manifest_json: str | None = None  # write the startup manifest here once healthy (the first 200 of /health)
    tool_call_parser: str = "auto"  # auto: the model family's (server/tool_parsers); none: tool calling off
    reasoning_parser: str | None = None  # None: reasoning stays in content (vLLM's default); auto: the family's

    def check_listen(self) -> None:
        """--host / --port can be listened on: refused in one line before any child starts (uvicorn found it only
        after the model had loaded). A port taken between this check and uvicorn's bind still fails there."""
        try:
            addrs = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as e:
            raise ValueError(f"--host: {self.host!r} does not resolve ({e.strerror})") from None
        family, kind, proto, _, addr = addrs[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                s.bind(addr)
            except OSError as e:
                flag = "--port" if e.errno in (errno.EADDRINUSE, errno.EACCES) else "--host"
                raise ValueError(f"{flag}: cannot listen on {self.host}:{self.port} ({e.strerror})") from None

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
        if self.tool_call_parser not in TOOL_PARSER_CHOICES:
            raise ValueError(f"--tool-call-parser: {self.tool_call_parser!r} is not one of "
                             f"{', '.join(TOOL_PARSER_CHOICES)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSER_CHOICES:
            raise ValueError(f"--reasoning-parser: {self.reasoning_parser!r} is not one of "
                             f"{', '.join(REASONING_PARSER_CHOICES)}")

    # ---- command line --------------------------------------------------------------------
    @staticmethod
    def add_cli_args(g: Any) -> None:
        g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
        g.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
        g.add_argument("--served-model-name", default=None, help="model name in the API (default: --model)")
        g.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on every route but /health and /metrics "
                            f"(default: the {API_KEY_ENV} environment variable; unset: no key)")
        g.add_argument("--max-queued-requests", type=int, default=1024,
                       help="samples accepted beyond those that can run at once (page-table rows and KV pool "
                            "pages) before answering 429; -1: unbounded")
        g.add_argument("--max-request-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
        g.add_argument("--health-timeout", type=float, default=20.0,
                       help="seconds the /health 1-token probe may take")
        g.add_argument("--startup-timeout", type=float, default=None,
                       help="exit with an error if the server is not Up after this many seconds (default: wait)")
        g.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds in-flight requests may take to finish after SIGTERM; those left then end "
                            "with an error")
        g.add_argument("--manifest-json", default=None, help="write the startup manifest here once healthy")
        g.add_argument("--tool-call-parser", default="auto", choices=TOOL_PARSER_CHOICES,
                       help="how tool calls are read from the output (vLLM/SGLang names): auto = the model "
                            "family's (glm47 for GLM-5, deepseek_v32 for DeepSeek-V3.2); none = tools refused")
        g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSER_CHOICES,
                       help="split <think>...</think> into reasoning_content (vLLM/SGLang names: glm45, "
                            "deepseek_v3; auto = the model family's); unset: reasoning stays in content")
        g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="log level of every process")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, engine: Any, model_dir: str) -> ServerArgs:
        return cls(
            model_dir=model_dir, served_model_name=ns.served_model_name or engine.model,
            engine_args={k: v for k, v in dataclasses.asdict(engine).items() if k != "model"},
            host=ns.host, port=ns.port, api_key=ns.api_key or envs.DSASERVE_API_KEY,
            max_queued_requests=None if ns.max_queued_requests == -1 else ns.max_queued_requests,
            max_request_bytes=ns.max_request_bytes, health_timeout_s=ns.health_timeout,
            drain_timeout_s=ns.drain_timeout, startup_timeout_s=ns.startup_timeout, log_level=ns.log_level,
            manifest_json=ns.manifest_json, tool_call_parser=ns.tool_call_parser,
            reasoning_parser=ns.reasoning_parser)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`(default: X)` after a flag's help only where it says something: not after a required flag, a
    default of None, or help that already names its default (BooleanOptionalAction adds its own)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.required or action.default is None or action.default is argparse.SUPPRESS
                or not action.option_strings or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)"
