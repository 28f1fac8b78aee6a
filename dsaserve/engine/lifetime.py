"""Child-process lifetime: a server's scheduler ranks and detokenizer, and an offline Engine's follower ranks,
die with the process that spawned them (startup chain, "spawn processes").

Owns: the two guards every child installs first thing. Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)` makes
the kernel kill the child when its parent dies (even by SIGKILL, when no cleanup code can run); a
watchdog thread covers the window before prctl took effect and non-Linux systems by polling the parent
pid. Children ignore SIGINT: Ctrl-C in a terminal reaches the whole process group, and the main
process, not each child, decides how to shut down (it drains, then terminates them).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
WATCHDOG_PERIOD_S = 0.5


def die_with_parent(parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl: nobody would ever kill us
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(WATCHDOG_PERIOD_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def setup_child_logging(name: str, level: str) -> logging.Logger:
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s [{name}] %(levelname)s %(message)s",
                        stream=sys.stderr)
    return logging.getLogger(f"dsaserve.{name}")


def spawn_child_process(module: str, cfg: dict, rank: int | None = None, world: int = 1,
                        local_rank: int = 0) -> subprocess.Popen:
    """`python -m module <cfg as JSON>` (nothing crosses by pickle); a rank also gets RANK / WORLD_SIZE /
    LOCAL_RANK. The child runs `start_child` first, so it dies with this process."""
    env = dict(os.environ)
    # Idle OpenMP threads of torch must sleep, not spin: spinning threads of one process starve the others on a
    # small CPU (measured: 64 batched requests took 26 s instead of 1.6 s on 2 cores). A user's own setting wins.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if rank is not None:
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
    return subprocess.Popen([sys.executable, "-m", module, json.dumps(cfg)], stdin=subprocess.DEVNULL, env=env)


def start_child(name: str, cfg: dict) -> logging.Logger:
    """What every child does first: die with the parent, log under its name."""
    die_with_parent(cfg["parent_pid"])
    return setup_child_logging(name, cfg.get("log_level", "info"))
