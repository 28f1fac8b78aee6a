"""Spawning a server's children: one scheduler process per GPU rank of this node and the detokenizer (startup
chain: "spawn processes").

Owns: which modules run as children, the config each gets, and `spawn_all`, which `dsaserve serve` calls as
soon as the model directory is resolved, before the HTTP stack is imported and the main process's tokenizer
loads: those (launcher_imports, main_tokenizer) then run while the children import torch, load weights,
profile memory and capture graphs. The children connect to sockets the main process binds later (ZMQ
queues and reconnects). Module scope imports only what `dsaserve serve` has already imported.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsaserve.engine.lifetime import spawn_child_process
from dsaserve.server.ipc import Endpoints, make_ipc_dir
from dsaserve.server.server_args import ServerArgs

SCHEDULER_MODULE, DETOKENIZER_MODULE = "dsaserve.server.scheduler_process", "dsaserve.server.detokenizer_process"


def engine_layout(args: ServerArgs) -> Any:
    """The EngineArgs the ranks are built from: the one place the world and this node's ranks are derived."""
    from dsaserve.engine.engine_args import EngineArgs

    return EngineArgs.from_kwargs(**{**args.engine_args, "model": args.model_dir})


def rank_name(rank: int) -> str:
    return "scheduler" if rank == 0 else f"scheduler rank {rank}"


def spawn_child(module: str, args: ServerArgs, ends: Endpoints | None, rank: int | None = None,
                layout: Any = None) -> subprocess.Popen:
    """A server child; a scheduler rank gets its place in `layout` (the EngineArgs, `engine_layout`)."""
    cfg = {"parent_pid": os.getpid(), "endpoints": ends.to_dict() if ends else None, "log_level": args.log_level,
           "spawn_time": time.time(), "model_dir": args.model_dir, "rank": rank,
           "engine_args": {**args.engine_args, "model": args.model_dir}}
    if rank is None:
        return spawn_child_process(module, cfg)
    return spawn_child_process(module, cfg, rank, layout.world_size, rank % layout.ranks_per_node)


def spawn_ranks(args: ServerArgs, ends: Endpoints | None) -> dict[str, subprocess.Popen]:
    """One scheduler process per rank of this node, by name."""
    layout = engine_layout(args)
    first = layout.node_rank * layout.ranks_per_node
    return {rank_name(r): spawn_child(SCHEDULER_MODULE, args, ends, r, layout)
            for r in range(first, first + layout.ranks_per_node)}


def spawn_all(args: ServerArgs, ends: Endpoints) -> dict[str, subprocess.Popen]:
    """Node 0's children: the ranks first (the longest start-up), then the detokenizer."""
    children = spawn_ranks(args, ends)
    children["detokenizer"] = spawn_child(DETOKENIZER_MODULE, args, ends)
    return children


@dataclass
class Spawned:
    """Children `dsaserve serve` started before the launcher was imported, and their socket directory."""

    ipc_dir: Path
    children: dict[str, subprocess.Popen]


def spawn_early(args: ServerArgs) -> Spawned:
    """The socket directory and every child of node 0, at once (dsaserve/server/spawn.py says why)."""
    ipc_dir = make_ipc_dir()
    try:
        return Spawned(ipc_dir, spawn_all(args, Endpoints.in_dir(ipc_dir)))
    except BaseException:
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise
