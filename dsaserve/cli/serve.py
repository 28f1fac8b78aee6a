"""`dsaserve serve`: an OpenAI-compatible HTTP server over one checkpoint (startup chain entry point).

    dsaserve serve                                  # built-in glm-5.3-tiny, made on first use, no download
    dsaserve serve --model /path/to/checkpoint --port 8000 --api-key KEY --max-running-requests 64

The server flags are here; every engine flag (`--num-pages`, `--max-num-batched-tokens`, ...) comes from
EngineArgs, so they mean the same as in `dsaserve generate`. `--model` (a checkpoint directory or a
built-in config name) is resolved once, here, so the main process, the scheduler and the detokenizer
all read the same directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    from dsaserve.engine.engine_args import EngineArgs

    p = subparsers.add_parser("serve", help="serve a model behind an OpenAI-compatible HTTP API",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="model name in the API (default: --model)")
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (not on /health, /metrics)")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="samples accepted beyond --max-running-requests before answering 429 (-1: unbounded)")
    g.add_argument("--max-request-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    g.add_argument("--health-timeout", type=float, default=20.0,
                   help="seconds the /health 1-token probe may take")
    g.add_argument("--startup-timeout", type=float, default=None,
                   help="exit with an error if the server is not Up after this many seconds (default: wait)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    g.add_argument("--manifest-json", default=None, help="write the startup manifest (GET /startup) here once Up")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    EngineArgs.add_cli_args(p.add_argument_group("engine"))
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    from dsaserve.config import load_config
    from dsaserve.distributed.parallel_state import free_port
    from dsaserve.engine.engine_args import EngineArgs
    from dsaserve.server.launcher import run
    from dsaserve.server.server_args import ServerArgs
    from dsaserve.weights.checkpoint_cache import CheckpointResolveError, resolve_model_dir

    try:
        engine = EngineArgs.from_cli_args(ns)
        model_dir = str(resolve_model_dir(engine.model, engine.load_format))
        engine.check_layout(load_config(model_dir))  # a bad layout or too few GPUs: refused before any spawn
        if engine.world_size > 1 and not engine.dist_init_addr:
            engine.dist_init_addr = f"127.0.0.1:{free_port()}"
        args = ServerArgs(
            model_dir=model_dir, served_model_name=ns.served_model_name or engine.model,
            engine_args={k: v for k, v in dataclasses.asdict(engine).items() if k != "model"},
            host=ns.host, port=ns.port, api_key=ns.api_key,
            max_queued_requests=None if ns.max_queued_requests == -1 else ns.max_queued_requests,
            max_request_bytes=ns.max_request_bytes, health_timeout_s=ns.health_timeout,
            drain_timeout_s=ns.drain_timeout, startup_timeout_s=ns.startup_timeout, log_level=ns.log_level,
            manifest_json=ns.manifest_json)
    except (ValueError, CheckpointResolveError) as e:
        print(f"dsaserve serve: {e}", file=sys.stderr)
        return 2
    return run(args)
