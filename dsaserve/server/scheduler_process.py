"""Scheduler process: owns the EngineCore (model + KV pool) and steps it (request path stages 2-10,
startup chain from "load weights" to "scheduler_info").

Owns: building the EngineCore (the whole device-side startup chain happens inside it), reporting
`scheduler_info` with per-phase `startup_time` to the main process (that report is what lets the server
go Up), and the loop: take every queued message (generate / abort / stats), step the core while it has
work, and send the step's token deltas to the detokenizer. A request is `register`ed with the
detokenizer (stop strings, prompt tail, ...) on the same socket, and so always before, its first delta.
Any exception in the loop is reported as `fatal` and ends the process: the main process then turns Down
and fails every pending request instead of leaving it hanging.

Test hook: `DSASERVE_TEST_READY_DELAY_S` sleeps before reporting ready, so tests can observe Starting.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from typing import Any

import zmq

from dsaserve.common import envs
from dsaserve.server import ipc
from dsaserve.server.lifetime import start_child

log = logging.getLogger(__name__)

IDLE_POLL_MS = 50  # how long an idle loop waits for a message before looking again


def plain(obj: Any) -> Any:
    """Make stats/info msgpack-safe: numbers, strings, lists and str-keyed maps; anything else as str."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [plain(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return plain(obj.item())
    return str(obj)


def build_core(engine_args: dict[str, Any]) -> Any:
    from dsaserve.engine.engine_args import EngineArgs
    from dsaserve.engine.engine_core import EngineCore

    return EngineCore(EngineArgs.from_kwargs(**engine_args))


class SchedulerLoop:
    """The message handling and stepping of one scheduler process (sockets injected for clarity)."""

    def __init__(self, core: Any, pull: zmq.Socket, to_detok: zmq.Socket, to_main: zmq.Socket) -> None:
        from dsaserve.common.counters import COUNTERS
        from dsaserve.common.sampling_params import SamplingParams
        from dsaserve.engine.request import EngineRequest

        self.core, self.pull, self.to_detok, self.to_main = core, pull, to_detok, to_main
        self.counters = COUNTERS
        self.EngineRequest, self.SamplingParams = EngineRequest, SamplingParams

    def run_forever(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        busy = self.core.has_unfinished()
        register: list[dict[str, Any]] = []
        drop: list[str] = []
        for msg in ipc.drain(self.pull, 0 if busy else IDLE_POLL_MS):
            self.handle(msg, register, drop)
        deltas = self.core.step() if self.core.has_unfinished() else []
        if register or deltas or drop:
            self.to_detok.send(ipc.pack(ipc.BATCH, register=register, drop=drop,
                                        deltas=[self._delta(d) for d in deltas]))

    def handle(self, msg: dict[str, Any], register: list[dict[str, Any]], drop: list[str]) -> None:
        kind = msg["t"]
        if kind == ipc.GENERATE:
            rid = msg["rid"]
            try:
                sampling = self.SamplingParams.from_dict(msg["sampling"])
                self.core.add_request(self.EngineRequest(rid, list(msg["input_ids"]), sampling,
                                                         msg.get("arrival_time") or time.time()))
            except (ValueError, TypeError, KeyError) as e:  # the core stays usable after a rejected request
                self.to_main.send(ipc.pack(ipc.REJECT, rid=rid, message=str(e)))
                return
            register.append({"rid": rid, "n": sampling.n, **msg.get("detok", {})})
        elif kind == ipc.ABORT:
            self.abort(msg["rid"], msg.get("index"), drop)
        elif kind == ipc.STATS_REQ:
            self.to_main.send(ipc.pack(ipc.STATS, qid=msg["qid"], **self.stats(bool(msg.get("check_leak")))))

    def abort(self, rid: str, index: int | None, drop: list[str]) -> None:
        """Abort a whole request (index None: the client went away) or one sample (its stop string matched).

        Only a whole request is dropped from the detokenizer: after a one-sample abort its siblings still
        stream, and the detokenizer already ended that sample itself."""
        try:
            self.core.abort_request(rid, index)
        except ValueError as e:  # a sample index the request does not have: a bug upstream, not a reason to die
            log.error("abort %s: %s", rid, e)
            return
        if index is None:
            drop.append(rid)

    def stats(self, check_leak: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"stats": plain(self.core.stats()), "counters": plain(self.counters.snapshot())}
        if check_leak:
            try:
                self.core.check_no_leak()
                out["leak"] = None
            except AssertionError as e:
                out["leak"] = str(e) or "check_no_leak failed"
        return out

    @staticmethod
    def _delta(d: Any) -> dict[str, Any]:
        return {"rid": d.request_id, "index": d.index, "ids": list(d.new_token_ids), "lps": plain(d.new_logprobs),
                "finished": d.finished, "reason": d.finish_reason, "prompt_tokens": d.prompt_tokens,
                "cached_tokens": d.cached_tokens}


def run(cfg: dict[str, Any]) -> None:
    t_start = time.time()
    log, ends = start_child("scheduler", cfg)
    ctx = zmq.Context()
    pull = ipc.pull_socket(ctx, ends.sched_in)
    to_detok = ipc.push_socket(ctx, ends.detok_in)
    to_main = ipc.push_socket(ctx, ends.main_in)
    try:
        core = build_core(cfg["engine_args"])
        info = plain(core.scheduler_info)
        info["startup_time"] = {"scheduler_spawn": round(t_start - cfg.get("spawn_time", t_start), 4),
                                **info.get("startup_time", {})}
        if hasattr(core, "manifest"):
            info["manifest"] = plain(core.manifest())
        delay = float(envs.DSASERVE_TEST_READY_DELAY_S or 0)
        if delay > 0:
            log.warning("DSASERVE_TEST_READY_DELAY_S=%s: delaying readiness (tests only)", delay)
            time.sleep(delay)
            info["startup_time"]["test_ready_delay"] = delay
    except Exception as e:
        to_main.send(ipc.pack(ipc.FATAL, who="scheduler", message=f"startup failed: {type(e).__name__}: {e}"))
        log.exception("startup failed")
        time.sleep(0.2)  # let the message leave before the process (and its socket) goes away
        sys.exit(1)
    info["pid"] = os.getpid()
    to_main.send(ipc.pack(ipc.READY, who="scheduler", info=info))
    log.info("ready: max_req_input_len=%s", info.get("max_req_input_len"))
    try:
        SchedulerLoop(core, pull, to_detok, to_main).run_forever()
    except Exception:
        msg = traceback.format_exc()
        log.error("scheduler loop died:\n%s", msg)
        to_main.send(ipc.pack(ipc.FATAL, who="scheduler", message=msg[-2000:]))
        time.sleep(0.2)
        sys.exit(1)


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
