"""Follower rank of the offline Engine: a process per rank > 0 that builds its share of the model and then
follows the leader (the Engine's own process, rank 0) through engine/rank_group.py (startup chain "spawn
processes" for `Engine(..., tensor_parallel_size=N)`; the server's ranks are its scheduler processes).

Owns: spawning the followers (one `python -m dsaserve.engine.rank_worker` per rank, RANK / WORLD_SIZE /
LOCAL_RANK in the environment, dying with the Engine's process) and their main function.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from typing import Any


def spawn_followers(engine_args: dict[str, Any], world: int) -> list[subprocess.Popen]:
    from dsaserve.engine.lifetime import spawn_child_process

    return [spawn_child_process(__name__, {"parent_pid": os.getpid(), "rank": rank, "engine_args": engine_args},
                                rank, world, local_rank=rank) for rank in range(1, world)]


def main(cfg: dict[str, Any]) -> None:
    from dsaserve.engine.lifetime import start_child
    from dsaserve.engine.rank_group import RankGroup, run_follower

    log = start_child(f"rank{cfg['rank']}", cfg)
    try:
        run_follower(RankGroup.build(cfg["engine_args"], cfg["rank"]))
    except Exception:
        log.error("rank %s failed:\n%s", cfg["rank"], traceback.format_exc())
        sys.exit(1)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
