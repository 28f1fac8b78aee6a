"""Scheduler process: one per GPU rank; owns that rank's EngineCore (model shard + KV pool) and steps it in
lockstep with the other ranks (request path stages 2-10, startup chain from "init distributed" to
"scheduler_info").

Owns: building the EngineCore (the whole device-side startup chain happens inside it, including the
rendezvous), and the loop. Rank 0 is the leader: it alone holds ZMQ sockets — it takes every queued
message (generate / abort / stats), validates new requests, hands them to the RankGroup (which shares
them with the other ranks and steps every rank; engine/rank_group.py), and sends the step's token deltas
to the detokenizer. A request is `register`ed with the detokenizer (stop strings, prompt tail, ...) on the
same socket, and so always before, its first delta. The leader reports `scheduler_info` — with every
rank's startup phases, weights, pool and graph buckets, and the slowest rank (by its own work, not its waits
for the others) — once every rank is built; that report lets the server go Up. A follower rank only steps.

Any exception is reported as `fatal` (naming the rank) and ends the process; the main process then turns
Down, fails every pending request and exits.

Every rank reports its own start-up before the engine's phases: `scheduler_spawn` (the launcher's Popen ->
this module's first line), `scheduler_imports` (this module's imports) and `engine_imports` (torch and the
engine, imported in `_start_up`, after the early CUDA context, Triton's hash and the kernel precompile have
started). DSASERVE_STARTUP_PROFILE runs `_start_up` under cProfile (common/startup_profile.py).

Test hook: `DSASERVE_TEST_READY_DELAY_S` sleeps before reporting ready, so tests can observe Starting.
"""

# ruff: noqa: E402 -- the clock is read before any import: the process reports its own import time
from __future__ import annotations

import time

FIRST_LINE = time.time()

import json
import logging
import os
import sys
import traceback
from itertools import zip_longest
from typing import Any

import zmq

from dsaserve.common import envs
from dsaserve.common.startup_profile import profiled
from dsaserve.common.wire import plain
from dsaserve.engine.lifetime import start_child
from dsaserve.errors import CheckpointError
from dsaserve.server import ipc
from dsaserve.server.startup_clock import child_phases

log = logging.getLogger(__name__)

IDLE_POLL_MS = 50  # how long an idle leader waits for a message before the next (empty) iteration
GATE_POLL_MS = 2  # ... while a parked request's grammar compiles: it is picked up within this much


def merge_stats(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """DP-attention: the ranks' scheduler stats summed (pages, requests and tokens add across pools; per-position
    counts position by position)."""
    out = dict(per_rank[0])
    for other in per_rank[1:]:
        for k, v in other.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(out.get(k), (int, float)):
                out[k] = out[k] + v
            elif isinstance(v, list) and isinstance(out.get(k), list):
                out[k] = [a + b for a, b in zip_longest(out[k], v, fillvalue=0)]
    return out


class SchedulerLoop:
    """The leader's message handling and stepping (sockets injected for clarity)."""

    def __init__(self, group: Any, pull: zmq.Socket, to_detok: zmq.Socket, to_main: zmq.Socket) -> None:
        from dsaserve.common.counters import COUNTERS
        from dsaserve.common.sampling_params import SamplingParams

        self.group, self.core = group, group.core
        self.pull, self.to_detok, self.to_main = pull, to_detok, to_main
        self.counters = COUNTERS
        self.SamplingParams = SamplingParams
        self.gate = group.gate  # structured requests waiting for every rank's compile (engine/grammar_gate.py)

    def run_forever(self) -> None:
        while True:
            self.run_once()

    def busy(self) -> bool:
        return self.core.has_unfinished() or any(self.group.busy) or self.gate.busy

    def poll_ms(self) -> int:
        """How long to wait for messages: not at all with work to step; briefly while only a grammar compiles
        (its thread needs the core; every iteration is a collective over the ranks); else the idle poll."""
        if self.core.has_unfinished() or any(self.group.busy):
            return 0
        return GATE_POLL_MS if self.gate.busy else IDLE_POLL_MS

    def run_once(self) -> None:
        register: list[dict[str, Any]] = []
        drop: list[str] = []
        stats_qids: list[tuple[str, bool]] = []
        for msg in ipc.drain(self.pull, self.poll_ms()):
            self.handle(msg, register, drop, stats_qids)
        deltas, stats = self.group.step()  # admits the parked requests every rank has compiled the grammar of
        for rid, message in self.group.take_rejects():  # registered with the detokenizer when parked
            self.to_main.send(ipc.pack(ipc.REJECT, rid=rid, message=message))
            drop.append(rid)
        for qid, error in self.group.take_checks():
            self.to_main.send(ipc.pack(ipc.GRAMMAR_RESULT, qid=qid, error=error))
        for qid, check_leak in stats_qids:
            self.to_main.send(ipc.pack(ipc.STATS, qid=qid, **self.stats(stats, check_leak)))
        if register or deltas or drop:
            self.to_detok.send(ipc.pack(ipc.BATCH, register=register, drop=drop,
                                        deltas=[self._delta(d) for d in deltas]))

    def handle(self, msg: dict[str, Any], register: list, drop: list, stats_qids: list) -> None:
        kind = msg["t"]
        if kind == ipc.GENERATE:
            self.generate(msg, register)  # a structured request waits in the gate until its grammar compiled
        elif kind == ipc.GRAMMAR_CHECK:
            self.group.check_grammar(msg.get("qid"), msg.get("spec"))
        elif kind == ipc.ABORT:
            self.abort(msg["rid"], msg.get("index"), drop)
        elif kind == ipc.STATS_REQ:
            self.group.want_stats()
            stats_qids.append((msg["qid"], bool(msg.get("check_leak"))))

    def generate(self, msg: dict[str, Any], register: list) -> None:
        rid = msg["rid"]
        try:
            sampling = self.SamplingParams.from_dict(msg["sampling"])
            self.group.add_request(rid, list(msg["input_ids"]), sampling, msg.get("arrival_time") or time.time())
        except (ValueError, TypeError, KeyError) as e:  # the core stays usable after a rejected request
            self.to_main.send(ipc.pack(ipc.REJECT, rid=rid, message=str(e)))
            return
        register.append({"rid": rid, "n": sampling.n, **msg.get("detok", {})})

    def abort(self, rid: str, index: int | None, drop: list[str]) -> None:
        """Abort a whole request (index None: the client went away) or one sample (its stop string matched).

        Only a whole request is dropped from the detokenizer: after a one-sample abort its siblings still
        stream, and the detokenizer already ended that sample itself. A request still waiting for its grammar
        leaves the gate (RankGroup.abort_request)."""
        try:
            self.group.abort_request(rid, index)
        except ValueError as e:  # a sample index the request does not have: a bug upstream, not a reason to die
            log.error("abort %s: %s", rid, e)
            return
        if index is None:
            drop.append(rid)

    def stats(self, per_rank: list[dict[str, Any]], check_leak: bool) -> dict[str, Any]:
        merged = merge_stats(per_rank) if per_rank else self.core.stats()
        out: dict[str, Any] = {"stats": plain(merged), "counters": plain(self.counters.snapshot())}
        if len(per_rank) > 1:  # DP-attention: each rank's own requests, pages and counters (/admin/stats)
            out["ranks"] = [plain(r) for r in per_rank]
        if check_leak:
            try:
                self.core.check_no_leak()
                out["leak"] = None
            except AssertionError as e:
                out["leak"] = str(e) or "check_no_leak failed"
        return out

    @staticmethod
    def _delta(d: Any) -> dict[str, Any]:
        out = {"rid": d.request_id, "index": d.index, "ids": list(d.new_token_ids), "lps": plain(d.new_logprobs),
               "finished": d.finished, "reason": d.finish_reason, "prompt_tokens": d.prompt_tokens,
               "cached_tokens": d.cached_tokens}
        if d.prompt_logprobs is not None:  # already plain: the engine built them from .tolist() (1 s of plain() at 32K)
            out["plps"] = d.prompt_logprobs
        return out


def rank_reports(group: Any, m: dict[str, Any], phases: dict[str, float]) -> list[dict[str, Any]]:
    """Every rank's startup phases (its process's spawn and imports, then the engine's), weights, KV pool and
    graph buckets (an all-gather over the ranks); `m` is this rank's manifest."""
    import msgpack

    from dsaserve.engine.rank_group import all_gather_bytes

    mine = plain({"rank": group.rank, "pid": os.getpid(), "device": m.get("device"), "startup_time": phases,
                  "weights": m.get("weights"), "kv_pool": m.get("kv_pool"),
                  "cuda_graph_buckets": (m.get("cuda_graph") or {}).get("buckets")})
    if group.group is None:
        return [mine]
    return [msgpack.unpackb(b, raw=False) for b in all_gather_bytes(msgpack.packb(mine), group.group)]


def scheduler_info(group: Any, process: dict[str, float]) -> dict[str, Any]:
    """What the leader reports; `process`: this process's own start-up phases (spawn, imports)."""
    core = group.core
    info = plain(core.scheduler_info)
    info["startup_time"] = {**process, **info.get("startup_time", {})}
    m = core.manifest()  # built once: it walks the pool, the kernels and the ledger's prediction
    info["manifest"] = plain(m)
    ranks = rank_reports(group, m, {**process, **(m.get("startup_time") or {})})
    info["ranks"] = ranks
    info["slowest_rank"] = slowest_rank(ranks)
    return info


# the runner's phases that end when every rank got there (the rendezvous, the first collective of each kind):
# a slow rank's seconds show up in them on every other rank, so they are not a rank's own
WAIT_PHASES = ("init_distributed", "warmup_collectives")


def slowest_rank(ranks: list[dict[str, Any]]) -> int:
    """The rank whose own start-up took longest (each report gets that sum as `own_startup_s`): its phases but
    those in which it waited for the others. Summing those too would count a slow rank's delay once more on
    every rank that waited for it, and every rank would look as slow as the slowest."""
    for r in ranks:
        r["own_startup_s"] = round(sum(v for k, v in (r.get("startup_time") or {}).items() if k not in WAIT_PHASES), 4)
    return max(ranks, key=lambda r: r["own_startup_s"])["rank"]


def _fatal(to_main: zmq.Socket | None, who: str, message: str, kind: str | None = None) -> None:
    log.error("%s: %s", who, message)
    if to_main is not None:
        to_main.send(ipc.pack(ipc.FATAL, who=who, message=message[-2000:], cause=kind))
        time.sleep(0.2)  # let the message leave before the process (and its socket) goes away
    sys.exit(1)


def _start_up(cfg: dict[str, Any], rank: int, t_start: float) -> tuple[Any, dict[str, Any]]:
    """This rank's engine, built: (its RankGroup, the scheduler info sent with READY)."""
    from dsaserve.engine import early_cuda, kernel_precompile, warm_start

    # first thing: the GPU's context is made, Triton's own hash computed, and the recorded kernels not yet compiled
    # compile, while torch imports and weights load (a CPU rank runs no Triton kernel: none of them)
    if early_cuda.start(cfg["engine_args"]).cuda:
        warm_start.prewarm_triton_key()
        kernel_precompile.start()
    t_imports = time.time()
    from dsaserve.engine.rank_group import RankGroup

    process = {**child_phases("scheduler", cfg.get("spawn_time"), FIRST_LINE, t_start),
               "engine_imports": round(time.time() - t_imports, 4)}
    group = RankGroup.build(cfg["engine_args"], rank)
    return group, scheduler_info(group, process)


def run(cfg: dict[str, Any]) -> None:
    t_start = time.time()
    rank = int(cfg.get("rank", 0))
    who = "scheduler" if rank == 0 else f"scheduler rank {rank}"
    start_child("scheduler" if rank == 0 else f"rank{rank}", cfg)
    ctx = zmq.Context()
    ends = ipc.Endpoints(**cfg["endpoints"]) if cfg.get("endpoints") else None
    to_main = ipc.push_socket(ctx, ends.main_in) if ends else None
    try:
        with profiled(f"startup-rank{rank}"):  # DSASERVE_STARTUP_PROFILE (common/startup_profile.py)
            group, info = _start_up(cfg, rank, t_start)
        delay = float(envs.DSASERVE_TEST_READY_DELAY_S or 0)
        if delay > 0 and rank == 0:
            log.warning("DSASERVE_TEST_READY_DELAY_S=%s: delaying readiness (tests only)", delay)
            time.sleep(delay)
            info["startup_time"]["test_ready_delay"] = delay
    except CheckpointError as e:  # one line naming the file or tensor: no traceback
        _fatal(to_main, who, str(e), kind="checkpoint")
    except Exception as e:
        log.exception("startup failed")
        _fatal(to_main, who, f"startup failed: {type(e).__name__}: {e}")
    try:
        if rank == 0:
            pull = ipc.pull_socket(ctx, ends.sched_in)
            to_detok = ipc.push_socket(ctx, ends.detok_in)
            info["pid"] = os.getpid()
            to_main.send(ipc.pack(ipc.READY, who="scheduler", info=info))
            log.info("ready: max_req_input_len=%s, %d rank(s)", info.get("max_req_input_len"), len(info["ranks"]))
            SchedulerLoop(group, pull, to_detok, to_main).run_forever()
        else:
            from dsaserve.engine.rank_group import run_follower

            run_follower(group)
    except Exception:
        _fatal(to_main, who, f"loop died: {traceback.format_exc()}")


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
