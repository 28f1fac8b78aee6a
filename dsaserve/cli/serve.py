"""`dsaserve serve`: an OpenAI-compatible HTTP server over one checkpoint (startup chain entry point).

    dsaserve serve                                  # built-in glm-5.3-tiny, made on first use, no download
    dsaserve serve --model /path/to/checkpoint --port 8000 --api-key KEY --max-running-requests 64

The server flags (server/server_args.py) include `--api-key`, else the `DSASERVE_API_KEY` environment
variable; every engine flag (`--num-pages`, `--max-num-batched-tokens`, ...) comes from
EngineArgs, so they mean the same as in `dsaserve generate`. `--model` (a checkpoint directory or a
built-in config name) is resolved once, here, so the main process, the scheduler and the detokenizer
all read the same directory.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    from dsaserve.engine.engine_args import EngineArgs
    from dsaserve.server.server_args import HelpFormatter, ServerArgs

    p = subparsers.add_parser("serve", help="serve a model behind an OpenAI-compatible HTTP API",
                              formatter_class=HelpFormatter)
    ServerArgs.add_cli_args(p.add_argument_group("server"))
    EngineArgs.add_cli_args(p.add_argument_group("engine"))
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    from dsaserve.engine.engine_args import EngineArgs
    from dsaserve.server.launcher import run
    from dsaserve.server.server_args import ServerArgs
    from dsaserve.weights.checkpoint_cache import CheckpointResolveError, resolve_checkpoint

    try:
        engine = EngineArgs.from_cli_args(ns)
        args = ServerArgs.from_cli_args(ns, engine, str(resolve_checkpoint(engine.model)))
    except (ValueError, CheckpointResolveError) as e:
        print(f"dsaserve serve: {e}", file=sys.stderr)
        return 2
    return run(args)
