"""Launcher: process topology, readiness gate and shutdown of `dsaserve serve` (startup chain, note 000).

Owns, in startup order: the IPC directory, the main process's tokenizer, binding the main PULL socket,
spawning the scheduler and detokenizer processes (plain `python -m` subprocesses: nothing crosses by
pickle, and both die with this process), the readiness state `Starting -> Up` (Up only when the
scheduler has reported `scheduler_info` and the detokenizer its tokenizer; `Down` when either reports a
fatal error or exits), the HTTP server (which listens from the start so `/health` can say 503), and
shutdown: SIGTERM/SIGINT stop new work, in-flight requests drain for up to `drain_timeout_s`, then the
children are terminated and the process exits 0.

A failure before the server ever was Up (bad checkpoint, ...) exits with status 1; a failure after Up
leaves the server reporting Down (503 on /health and generation, pending requests failed) so that an
orchestrator sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from dsaserve.server.api import build_app
from dsaserve.server.hf_tokenizer import HFTokenizer
from dsaserve.server.ipc import Endpoints
from dsaserve.server.metrics import ServerMetrics
from dsaserve.server.server_args import ServerArgs
from dsaserve.server.tokenizer_manager import TokenizerManager

log = logging.getLogger("dsaserve.server")

CHILDREN = ("scheduler", "detokenizer")
CHILD_MODULES = {"scheduler": "dsaserve.server.scheduler_process", "detokenizer": "dsaserve.server.detokenizer_process"}
WATCH_PERIOD_S = 0.1  # how often child processes are polled for exit
TERMINATE_GRACE_S = 5.0


class State(enum.Enum):
    STARTING = "Starting"
    UP = "Up"
    DOWN = "Down"


class Readiness:
    """Starting -> Up -> (Down); plus `draining` after SIGTERM. Also collects the startup phases."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.state = State.STARTING
        self.reason = ""
        self.draining = False
        self.info: dict[str, dict[str, Any]] = {}
        self.phases: dict[str, float] = {}
        self.on_down: list[Callable[[str], None]] = []
        self.on_up: list[Callable[[], None]] = []
        self.pids: dict[str, int] = {"main": os.getpid()}

    @property
    def is_up(self) -> bool:
        return self.state is State.UP and not self.draining

    def describe(self) -> str:
        if self.draining:
            return "draining (shutting down)"
        return self.state.value + (f": {self.reason}" if self.reason else "")

    def phase(self, name: str, since: float) -> None:
        self.phases[name] = round(time.perf_counter() - since, 4)

    def mark_ready(self, who: str, info: dict[str, Any]) -> None:
        if self.state is not State.STARTING:
            return
        self.info[who] = info
        self.phase(f"{who}_ready", self.t0)
        if all(c in self.info for c in CHILDREN):
            self.phase("up", self.t0)
            self.state = State.UP
            log.info("server is Up after %.2f s (max_req_input_len=%s)", self.phases["up"],
                     self.info["scheduler"].get("max_req_input_len"))
            for cb in self.on_up:
                cb()

    def mark_down(self, reason: str) -> None:
        if self.state is State.DOWN:
            return
        self.state, self.reason = State.DOWN, reason[:2000]
        log.error("server is Down: %s", reason)
        for cb in self.on_down:
            cb(reason)

    def startup_time(self) -> dict[str, float]:
        engine = dict(self.info.get("scheduler", {}).get("startup_time", {}))
        return {**engine, **self.phases}

    def manifest(self, args: ServerArgs) -> dict[str, Any]:
        sched = dict(self.info.get("scheduler", {}))
        engine = sched.pop("manifest", {}) or {}
        return {
            "state": self.state.value, "reason": self.reason or None, "draining": self.draining,
            "model": args.served_model_name, "model_dir": args.model_dir,
            "startup_time": self.startup_time(),
            "max_req_input_len": sched.get("max_req_input_len"),
            "weights": engine.get("weights"), "kv_pool": engine.get("kv_pool"),
            "scheduler_info": sched, "engine": {k: v for k, v in engine.items() if k not in ("weights", "kv_pool")},
            "processes": self.pids,
        }


class _Server(uvicorn.Server):
    """uvicorn, but a signal means: stop taking work, drain, exit 0 (not re-raise the signal afterwards)."""

    def __init__(self, config: uvicorn.Config, readiness: Readiness) -> None:
        super().__init__(config)
        self.readiness = readiness

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.readiness.draining = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def report_startup(args: ServerArgs, readiness: Readiness) -> None:
    """The startup manifest in the log (seconds per phase) and, with --manifest-json, as a file."""
    phases = ", ".join(f"{k} {v:.3f}s" for k, v in readiness.startup_time().items())
    log.info("startup phases: %s", phases)
    if args.manifest_json:
        with open(args.manifest_json, "w") as f:
            json.dump(readiness.manifest(args), f, indent=2, default=str)
            f.write("\n")


def spawn_child(name: str, args: ServerArgs, ends: Endpoints) -> subprocess.Popen:
    cfg = {"parent_pid": os.getpid(), "endpoints": ends.to_dict(), "log_level": args.log_level,
           "spawn_time": time.time(), "model_dir": args.model_dir,
           "engine_args": {**args.engine_args, "model": args.model_dir}}
    env = dict(os.environ)
    # Idle OpenMP threads of torch must sleep, not spin: spinning threads of the scheduler starve the main
    # and detokenizer processes on a small CPU (measured: 64 batched requests took 26 s instead of 1.6 s
    # on 2 cores). A user's own setting wins.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return subprocess.Popen([sys.executable, "-m", CHILD_MODULES[name], json.dumps(cfg)], stdin=subprocess.DEVNULL,
                            env=env)


async def watch_children(children: dict[str, subprocess.Popen], readiness: Readiness, server: _Server,
                         startup_timeout_s: float | None) -> None:
    """A child that exits is a fatal fault: Down (and, before the server was ever Up, exit). So is a
    startup chain that takes longer than --startup-timeout (a rank stuck in a rendezvous, say)."""
    while True:
        for name, proc in children.items():
            rc = proc.poll()
            if rc is not None and readiness.state is not State.DOWN:
                readiness.mark_down(f"{name} process exited with code {rc}")
        waited = time.perf_counter() - readiness.t0
        if readiness.state is State.STARTING and startup_timeout_s is not None and waited > startup_timeout_s:
            readiness.mark_down(f"startup did not finish within --startup-timeout {startup_timeout_s:g} s")
        if readiness.state is State.DOWN and "up" not in readiness.phases and not server.should_exit:
            log.error("startup failed, exiting: %s", readiness.reason)
            server.exit_code = 1
            server.should_exit = True
        await asyncio.sleep(WATCH_PERIOD_S)


def stop_children(children: dict[str, subprocess.Popen]) -> None:
    for proc in children.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for proc in children.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def serve(args: ServerArgs) -> int:
    readiness = Readiness()
    ipc_dir = tempfile.mkdtemp(prefix="dsaserve-ipc-")
    children: dict[str, subprocess.Popen] = {}
    t = time.perf_counter()
    tok = HFTokenizer(args.model_dir)
    readiness.phase("main_tokenizer", t)
    metrics = ServerMetrics(readiness)
    tm = TokenizerManager(tok, Endpoints.in_dir(ipc_dir), readiness, metrics, args.max_queued_requests)
    readiness.on_down.append(tm.fail_all)
    readiness.on_up.append(lambda: report_startup(args, readiness))
    tm.bind()
    try:
        t = time.perf_counter()
        for name in CHILDREN:
            children[name] = spawn_child(name, args, tm.endpoints)
            readiness.pids[name] = children[name].pid
        readiness.phase("spawn_processes", t)
        tm.start()
        app = build_app(args, tm, readiness, metrics)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="off",
                                timeout_graceful_shutdown=int(args.drain_timeout_s), access_log=False)
        server = _Server(config, readiness)
        server.exit_code = 0
        watcher = asyncio.get_running_loop().create_task(watch_children(children, readiness, server,
                                                                         args.startup_timeout_s))
        await server.serve()
        watcher.cancel()
        return server.exit_code
    finally:
        stop_children(children)
        await tm.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def run(args: ServerArgs) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s [main] %(levelname)s %(message)s")
    return asyncio.run(serve(args))
