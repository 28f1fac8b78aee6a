"""Launcher: process topology, readiness gate and shutdown of `dsaserve serve` (startup chain, note 000).

Owns, in startup order: the IPC directory, the main process's tokenizer, binding the main PULL socket,
spawning one scheduler process per GPU rank of this node and the detokenizer (plain `python -m`
subprocesses: nothing crosses by pickle, and all die with this process), the readiness state
`Starting -> Up` (Up only when the leader scheduler has reported `scheduler_info` — which it does once every
rank is built — and the detokenizer its tokenizer; `Down` when any child reports a fatal error or exits),
the end of start-up (the first health probe, sent at Up: the entry point's StartupClock stops there and the
"startup phases" line and --manifest-json are written),
the HTTP server (which listens from the start so `/health` can say 503), and shutdown: SIGTERM/SIGINT stop
new work (503 error objects while the listener stays open), in-flight requests drain for up to
`drain_timeout_s` and those left end with an error object (a stream: an SSE error event and [DONE]), then
the children are terminated and the process exits 0.

Failing fast (as vLLM and SGLang): any child that dies — a rank killed, out of memory, stuck in a
collective past `--dist-timeout` — turns the server Down at once (503, pending requests failed with the
cause), and a moment later the process stops the other children and exits 1 with the cause, naming the
rank, so that a supervisor restarts it. Nodes other than 0 (`--node-rank` > 0) run only their ranks: no
HTTP, no tokenizer; they exit 1 as soon as one of their ranks exits.
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
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from dsaserve.common import envs
from dsaserve.server.api import build_app
from dsaserve.server.hf_tokenizer import HFTokenizer
from dsaserve.server.ipc import Endpoints, make_ipc_dir
from dsaserve.server.metrics import ServerMetrics
from dsaserve.server.server_args import ServerArgs
from dsaserve.server.spawn import Spawned, engine_layout, spawn_all, spawn_ranks
from dsaserve.server.startup_clock import StartupClock
from dsaserve.server.tokenizer_manager import TokenizerManager

log = logging.getLogger("dsaserve.server")

CHILDREN = ("scheduler", "detokenizer")  # the two that must report ready (the leader rank speaks for all)
WATCH_PERIOD_S = 0.1  # how often child processes are polled for exit
TERMINATE_GRACE_S = 5.0
DOWN_EXIT_GRACE_S = 1.0  # after a fault: pending requests get their 503 / error event, then the process exits
FLUSH_S = 5  # after the drain: responses still being written get this long before uvicorn cancels them


class State(enum.Enum):
    STARTING = "Starting"
    UP = "Up"
    DOWN = "Down"


class Readiness:
    """Starting -> Up -> (Down); plus `draining` after SIGTERM. Also collects the startup phases (its
    StartupClock: from the process's creation to the first passing health probe)."""

    def __init__(self, clock: StartupClock | None = None) -> None:
        self.t0 = time.perf_counter()
        self.clock = clock or StartupClock()
        self.state = State.STARTING
        self.reason = ""
        self.kind: str | None = None
        self.draining = False
        self.info: dict[str, dict[str, Any]] = {}
        self.on_down: list[Callable[[str], None]] = []
        self.on_up: list[Callable[[], None]] = []
        self.on_healthy: list[Callable[[], None]] = []
        self.pids: dict[str, int] = {"main": os.getpid()}

    @property
    def is_up(self) -> bool:
        return self.state is State.UP and not self.draining

    def describe(self) -> str:
        if self.draining:
            return "draining (shutting down)"
        return self.state.value + (f": {self.reason}" if self.reason else "")

    @property
    def phases(self) -> dict[str, float]:
        """The main process's startup phases and milestones so far ("up" once Up)."""
        return self.clock.phases()

    def mark_ready(self, who: str, info: dict[str, Any]) -> None:
        if self.state is not State.STARTING:
            return
        self.info[who] = info
        self.clock.milestone(f"{who}_ready")
        if all(c in self.info for c in CHILDREN):
            self.clock.lap("wait_for_ready")
            self.clock.milestone("up")
            self.state = State.UP
            log.info("server is Up after %.2f s (max_req_input_len=%s)", self.phases["up"],
                     self.info["scheduler"].get("max_req_input_len"))
            for cb in self.on_up:
                cb()

    def mark_healthy(self) -> None:
        """A health probe passed: the first time, startup is over (its last phase, `health_probe`, ends)."""
        if self.state is not State.UP or self.clock.done:
            return
        self.clock.lap("health_probe")
        log.info("healthy after %.2f s from the process's start", self.clock.total_s())
        for cb in self.on_healthy:
            cb()

    def mark_down(self, reason: str, kind: str | None = None, expected: bool = False) -> None:
        """`kind` "checkpoint": a broken checkpoint found by a rank (exit 2 before Up, like the CLI's own check).
        `expected`: part of a shutdown already under way (logged as a warning, not an error)."""
        if self.state is State.DOWN:
            return
        self.state, self.reason, self.kind = State.DOWN, reason[:2000], kind
        (log.warning if expected else log.error)("server is Down: %s", reason)
        for cb in self.on_down:
            cb(reason)

    def startup_time(self) -> dict[str, float]:
        """The main process's critical path, then each child's own phases, then milestones and total_s."""
        c = self.clock
        children = {k: v for who in CHILDREN for k, v in (self.info.get(who, {}).get("startup_time") or {}).items()}
        return {**c.laps, **children, **c.phases()}

    def startup(self, engine: dict[str, Any]) -> dict[str, Any]:
        """total_s, the phases that add up to it, and what every cache did on this start."""
        caches = dict(self.clock.caches)
        compiled = engine.get("compile_cache")
        caches["compile"] = compiled or {"status": "not used (no Triton kernels on this device)"}
        warm = engine.get("warm_start")
        if warm:  # the kernel preload and the memory profile of engine/warm_start.py: hit / miss each
            caches["warm_start"] = {k: v for k, v in warm.items() if k != "memory_profile"}
            caches["memory_profile"] = {"status": warm.get("memory_profile")}
        clock = {"interpreter_clock": self.clock.interpreter_clock} if self.clock.interpreter_clock else {}
        return {"total_s": self.clock.total_s(), "critical_path": list(self.clock.laps), **clock, "caches": caches}

    def manifest(self, args: ServerArgs) -> dict[str, Any]:
        sched = dict(self.info.get("scheduler", {}))
        engine = sched.pop("manifest", {}) or {}
        return {
            "state": self.state.value, "reason": self.reason or None, "draining": self.draining,
            "model": args.served_model_name, "model_dir": args.model_dir,
            "startup_time": self.startup_time(), "startup": self.startup(engine),
            "max_req_input_len": sched.get("max_req_input_len"),
            "weights": engine.get("weights"), "kv_pool": engine.get("kv_pool"),
            "scheduler_info": sched, "engine": {k: v for k, v in engine.items() if k not in ("weights", "kv_pool")},
            "processes": self.pids,
        }


class _Server(uvicorn.Server):
    """uvicorn, but a signal means: answer new requests 503 while in-flight ones drain (tm.drain: up to
    --drain-timeout, then the rest end with an error object), then exit 0 (not re-raise the signal)."""

    def __init__(self, config: uvicorn.Config, readiness: Readiness, tm: TokenizerManager, drain_s: float) -> None:
        super().__init__(config)
        self.readiness, self.tm, self.drain_s = readiness, tm, drain_s
        self.loop = asyncio.get_running_loop()
        self.drain_task: asyncio.Future | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.readiness.draining:  # a second signal: stop now (a second Ctrl-C: without waiting)
            self.force_exit = self.force_exit or sig == signal.SIGINT
            self.should_exit = True
            return
        self.readiness.draining = True
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        async def drain_then_exit() -> None:
            await self.tm.drain(self.drain_s)
            self.should_exit = True

        self.drain_task = asyncio.ensure_future(drain_then_exit())


def report_startup(args: ServerArgs, readiness: Readiness) -> None:
    """The startup manifest in the log (seconds per phase, total_s last) and, with --manifest-json, as a file;
    once, when the first health probe passed."""
    phases = ", ".join(f"{k} {v:.3f}s" for k, v in readiness.startup_time().items())
    log.info("startup phases: %s", phases)
    if readiness.clock.interpreter_clock:
        log.info("startup clock: the interpreter lap is %s", readiness.clock.interpreter_clock)
    if args.manifest_json:
        with open(args.manifest_json, "w") as f:
            json.dump(readiness.manifest(args), f, indent=2, default=str)
            f.write("\n")


async def watch_children(children: dict[str, subprocess.Popen], readiness: Readiness, server: _Server,
                         startup_timeout_s: float | None) -> None:
    """A child that exits is a fatal fault: Down at once, then exit 1 (before Up: at once; after Up: once the
    pending requests have had DOWN_EXIT_GRACE_S to get their error). So is a startup chain that takes longer
    than --startup-timeout (a rank stuck in a rendezvous, say)."""
    down_since: float | None = None
    # the test hook: a test that inspects a Down server on a loaded machine needs longer than the 1 s
    grace_s = float(envs.DSASERVE_TEST_DOWN_EXIT_GRACE_S or DOWN_EXIT_GRACE_S)
    exited: dict[str, str] = {}  # every child seen dead: the root cause is often a rank, not who reported first
    while True:
        for name, proc in children.items():
            rc = proc.poll()
            if rc is not None and name not in exited:
                exited[name] = f"{name} process (pid {proc.pid}) exited with code {rc}"
                # SIGTERM to the whole process group (systemd, `timeout`): the children die with the drain
                stopped = readiness.draining and rc == -signal.SIGTERM
                readiness.mark_down(exited[name] + (" (SIGTERM while draining)" if stopped else ""),
                                    expected=stopped)
        waited = time.perf_counter() - readiness.t0
        if readiness.state is State.STARTING and startup_timeout_s is not None and waited > startup_timeout_s:
            readiness.mark_down(f"startup did not finish within --startup-timeout {startup_timeout_s:g} s")
        if readiness.state is State.DOWN and not server.should_exit:
            down_since = down_since if down_since is not None else time.perf_counter()
            if "up" not in readiness.phases or time.perf_counter() - down_since >= grace_s:
                others = [why for why in exited.values() if why not in readiness.reason]
                log.error("exiting: %s", "; ".join([readiness.reason, *others]))
                server.exit_code = 1
                if readiness.kind == "checkpoint" and "up" not in readiness.phases:
                    print(f"dsaserve serve: error: {readiness.reason.split(': ', 1)[-1]}", file=sys.stderr)
                    server.exit_code = 2
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


def probe_at_up(args: ServerArgs, tm: TokenizerManager, readiness: Readiness, tasks: list[asyncio.Task]) -> None:
    """At Up the first health probe runs at once (a client's /health meanwhile shares it), so startup ends
    — and its phases are logged — when /health can first answer 200, whether or not anyone asked yet."""
    async def probe() -> None:
        if await tm.health(args.health_timeout_s) is None:
            readiness.mark_healthy()

    tasks.append(asyncio.get_running_loop().create_task(probe(), name="first-health-probe"))


async def serve(args: ServerArgs, clock: StartupClock | None = None, early: Spawned | None = None) -> int:
    """`early`: children already running (spawned before the launcher's imports); else spawned here, after
    the main tokenizer."""
    readiness = Readiness(clock)
    children: dict[str, subprocess.Popen] = dict(early.children) if early else {}
    ipc_dir = early.ipc_dir if early else None
    probes: list[asyncio.Task] = []
    tm = None
    try:
        readiness.pids.update({name: p.pid for name, p in children.items()})
        tok = HFTokenizer(args.model_dir)
        readiness.clock.lap("main_tokenizer")
        ipc_dir = ipc_dir or make_ipc_dir()  # after the tokenizer: a broken tokenizer leaves nothing behind
        metrics = ServerMetrics(readiness)
        tm = TokenizerManager(tok, Endpoints.in_dir(ipc_dir), readiness, metrics, args.max_queued_requests)
        readiness.on_down.append(tm.fail_all)
        readiness.on_up.append(lambda: probe_at_up(args, tm, readiness, probes))
        readiness.on_healthy.append(lambda: report_startup(args, readiness))
        tm.bind()
        if not early:
            children.update(spawn_all(args, tm.endpoints))
            readiness.pids.update({name: p.pid for name, p in children.items()})
            readiness.clock.lap("spawn_processes")
        tm.start()
        app = build_app(args, tm, readiness, metrics)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="off",
                                timeout_graceful_shutdown=FLUSH_S, access_log=False)
        server = _Server(config, readiness, tm, args.drain_timeout_s)
        server.exit_code = 0
        watcher = asyncio.get_running_loop().create_task(watch_children(children, readiness, server,
                                                                         args.startup_timeout_s))
        await server.serve()
        watcher.cancel()
        return server.exit_code
    finally:
        for task in probes:
            task.cancel()
        stop_children(children)
        if tm is not None:
            await tm.close()
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)


def serve_ranks_only(args: ServerArgs) -> int:
    """A node other than 0: its ranks, watched; exit 1 with the cause when one exits, 0 after SIGTERM."""
    stopping = False

    def on_signal(sig: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    children = spawn_ranks(args, None)
    log.info("node %s: ranks %s started", args.engine_args.get("node_rank"), ", ".join(children))
    try:
        while not stopping:
            for name, proc in children.items():
                rc = proc.poll()
                if rc is not None:
                    log.error("exiting: %s process (pid %s) exited with code %s", name, proc.pid, rc)
                    return 1
            time.sleep(WATCH_PERIOD_S)
        return 0
    finally:
        stop_children(children)


def run(args: ServerArgs, clock: StartupClock | None = None, early: Spawned | None = None) -> int:
    """`clock`: the entry point's StartupClock (started at its first line); a new one starts here if none.
    `early`: node 0's children, already spawned (`spawn_early`)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s [main] %(levelname)s %(message)s")
    if engine_layout(args).node_rank > 0:
        return serve_ranks_only(args)
    return asyncio.run(serve(args, clock, early))
