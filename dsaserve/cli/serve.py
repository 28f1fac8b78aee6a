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
    from dsaserve.cli import FIRST_LINE
    from dsaserve.common import bytecode_cache
    from dsaserve.common.wire import free_port
    from dsaserve.config import load_config
    from dsaserve.engine.engine_args import EngineArgs
    from dsaserve.errors import CheckpointError
    from dsaserve.server.server_args import ServerArgs
    from dsaserve.server.startup_clock import StartupClock
    from dsaserve.weights.checkpoint_cache import resolve_model_dir
    from dsaserve.weights.checkpoint_check import check_checkpoint

    clock = StartupClock(FIRST_LINE)
    clock.lap("cli_imports")
    clock.cache("bytecode", **bytecode_cache.report())  # common/bytecode_cache.py: where the .pyc files live
    try:
        engine = EngineArgs.from_cli_args(ns)
        engine.check_device()
        cache: dict = {}
        model_dir = str(resolve_model_dir(engine.model, engine.load_format, cache))
        clock.cache("model_files", **cache)
        # a broken checkpoint fails here, in one line, before any child starts (dummy weights: no files)
        cfg = load_config(model_dir) if engine.load_format == "dummy" else check_checkpoint(model_dir,
                                                                                            with_tokenizer=True)
        engine.check_layout(cfg)  # a bad layout or too few GPUs: refused before any spawn
        if engine.world_size > 1 and not engine.dist_init_addr:
            engine.dist_init_addr = f"127.0.0.1:{free_port()}"
        args = ServerArgs.from_cli_args(ns, engine, model_dir)
        if engine.node_rank == 0:
            args.check_listen()
    except ValueError as e:  # a bad flag, or a CheckpointError naming the file or tensor
        print(f"dsaserve serve: error: {e}", file=sys.stderr)
        return 2
    clock.lap("resolve_model")
    # the children first: their imports, weights, memory profile and graphs run while this process imports
    # the HTTP stack and loads its tokenizer (node 0; other nodes spawn their ranks in the launcher)
    early = None
    if engine.node_rank == 0:
        from dsaserve.server.spawn import spawn_early

        early = spawn_early(args)
        clock.lap("spawn_processes")
    from dsaserve.server.launcher import run

    clock.lap("launcher_imports")
    try:
        return run(args, clock, early)
    except CheckpointError as e:  # raised in this process (its tokenizer); the scheduler's come back as FATAL
        print(f"dsaserve serve: error: {e}", file=sys.stderr)
        return 2
