"""RankGroup: the control plane that keeps the scheduler ranks of one deployment in lockstep (request path
2-3 across ranks; docs/PARALLELISM.md, "Serving over ranks").

Owns: who hears requests, how every rank learns of them, and who steps when. Rank 0, the leader, is the
only rank that hears requests (the server's ZMQ socket, or the offline Engine's calls). Each loop
iteration it broadcasts what it heard over a CPU (gloo) group — msgpack bytes, never pickle — and every
rank applies the same messages in the same order:

  TP (and EP without DP-attention): every rank runs the same deterministic scheduler over the same
    requests and so forms the same batch; only the messages cross, never a batch (SGLang's choice: one
    small broadcast per iteration instead of a batch's tensors). Sampling agrees because the logits are
    identical after the vocab all-gather and every rank's sampler is seeded alike. Only the leader
    reports deltas.
  DP-attention: the leader routes each new request to one attention rank — the one with the fewest
    unfinished requests (ties: the lowest rank); routing is not prefix-aware — and every rank schedules
    its own requests over its own KV pool. The leader decides per iteration whether any rank has work
    (each rank's report of the previous iteration, plus what it routes now) and broadcasts that with the
    messages; then every rank steps, a rank with nothing scheduled running an idle forward so that the MoE
    all-to-alls match, and an all-gather brings every rank's deltas (and stats, when asked) to the leader.

A structured-output request first waits in the grammar gate (engine/grammar_gate.py): its compile starts on
every rank when it arrives, the ranks all-gather their compile status while any grammar is pending, and the
leader admits it (or rejects it, on every rank alike) once every rank has it compiled.

With one rank none of this communicates: the same calls run locally.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.common.wire import plain
from dsaserve.engine.engine_core import EngineCore
from dsaserve.engine.grammar_gate import GrammarGate, Wait
from dsaserve.engine.request import EngineRequest, TokenDelta

log = logging.getLogger(__name__)

GENERATE, ABORT, STATS, STOP = "generate", "abort", "stats", "stop"  # control-plane message kinds
GRAMMAR, GRAMMAR_END = "grammar", "grammar_end"  # a gate entry opened (compile it) / decided (drop it)
HEAD_BYTES = 16 << 10  # one broadcast carries a loop's messages up to this size; larger ones take a second


class RankGroup:
    """Per rank. The leader calls `add_request` / `abort_request` / `want_stats` (applied to its own core at
    once, queued for the others) and then `step()`; a follower only calls `step()` (see `run_follower`)."""

    def __init__(self, core: EngineCore, dp_attention: bool = False, timeout_s: float = 600.0) -> None:
        self.core = core
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.dp = dp_attention and self.world > 1
        self.group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                      if self.world > 1 else None)
        self.outbox: list[dict[str, Any]] = []  # leader: messages the other ranks have not seen yet
        self.owner: dict[str, list[int]] = {}  # leader, DP: request id -> [its attention rank, samples left]
        self.busy = [False] * self.world  # leader, DP: who still had work after the last iteration
        self.stats_wanted = False
        self.stopped = False
        self._head = torch.zeros(HEAD_BYTES + 8, dtype=torch.uint8)  # every iteration's broadcast, reused
        self.gate = GrammarGate(core, self.world)  # structured requests waiting for every rank's compile
        self.rejected: list[tuple[str, str]] = []  # leader: (rid, reason) of parked requests the gate refused
        self.checked: list[tuple[Any, str | None]] = []  # leader: (qid, None or the reason) of grammar checks

    @classmethod
    def build(cls, engine_args: dict[str, Any], rank: int | None = None) -> RankGroup:
        """This rank's EngineCore (joining the process group when there are several ranks) in its group."""
        from dsaserve.engine.engine_args import EngineArgs

        args = EngineArgs.from_kwargs(**engine_args)
        return cls(EngineCore(args, rank=rank), dp_attention=args.enable_dp_attention, timeout_s=args.dist_timeout)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # ---- leader: requests in -----------------------------------------------------------------
    def add_request(self, request_id: str, prompt: list[int], sampling: SamplingParams, arrival_time: float) -> None:
        """Admit a request (ValueError naming the field if the scheduler refuses it: every rank's limits are
        the same, so the leader decides for all); under DP-attention address it to the least-loaded rank.
        A structured request is parked in the grammar gate instead (a spec refused before any compile is a
        ValueError now): a later `step()` admits it once every rank has compiled its grammar, or lists it in
        `take_rejects()`."""
        if request_id in self.owner or request_id in self.gate.parked:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        if sampling.structured_outputs is None:
            self._admit(request_id, prompt, sampling, arrival_time)
            return
        self.core.scheduler.check_request(request_id, prompt, sampling)  # refused before any compile starts
        w = self.gate.open(sampling.structured_outputs, rid=request_id, request=(list(prompt), sampling, arrival_time))
        if w.error is not None:
            self.gate.end([w.gid])
            raise ValueError(f"structured_outputs: {w.error}")
        self._announce(w)

    def check_grammar(self, qid: Any, spec: Any) -> None:
        """A grammar check (the server's 400 before its response starts): `take_checks()` answers it once every
        rank has compiled the spec, or one of them could not."""
        self._announce(self.gate.open(spec, qid=qid))

    def waiting(self, request_id: str) -> bool:
        """The request is parked in the grammar gate."""
        return request_id in self.gate.parked

    def take_rejects(self) -> list[tuple[str, str]]:
        """(rid, reason) of the parked requests refused since the last call: their grammar did not compile on
        some rank, or not within the timeout. They never reached any rank's scheduler."""
        out, self.rejected = self.rejected, []
        return out

    def take_checks(self) -> list[tuple[Any, str | None]]:
        """(qid, None when compiled on every rank, else the reason) of the grammar checks decided since."""
        out, self.checked = self.checked, []
        return out

    def _announce(self, w: Wait) -> None:
        """The other ranks start the same compile when they get this (the spec's canonical text)."""
        if self.group is not None and w.error is None:
            self.outbox.append({"t": GRAMMAR, "gid": w.gid, "kind": w.spec.kind, "value": w.spec.value})

    def _admit(self, request_id: str, prompt: list[int], sampling: SamplingParams, arrival_time: float,
               w: Wait | None = None) -> None:
        dest = self._route() if self.dp else 0
        if dest == self.rank:
            grammar = None if w is None else (w.spec, w.compiled)
            self.core.add_request(EngineRequest(request_id, list(prompt), sampling, arrival_time), grammar=grammar)
        else:
            self.core.scheduler.check_request(request_id, prompt, sampling)
        if self.dp:
            self.owner[request_id] = [dest, sampling.n]
        if self.group is not None:
            self.outbox.append({"t": GENERATE, "rid": request_id, "ids": list(prompt), "sampling": sampling.to_dict(),
                                "arrival": arrival_time, "dest": dest, "gid": None if w is None else w.gid})

    def _settle_grammars(self) -> None:
        """Leader, before the broadcast: the gate's decisions. An admitted request joins this iteration's
        messages, so every rank adds it at the same step (TP ranks keep identical schedulers)."""
        done = self.gate.settle()
        for w in done:
            if w.rid is None:
                self.checked.append((w.qid, w.error))
            elif w.error is not None:
                self.rejected.append((w.rid, f"structured_outputs: {w.error}"))
            else:
                try:
                    self._admit(w.rid, *w.request, w)
                except ValueError as e:  # the scheduler refused it after all (e.g. its id came back meanwhile)
                    self.rejected.append((w.rid, str(e)))
        if done and self.group is not None:  # after the GENERATEs: a follower reads their grammars first
            self.outbox.append({"t": GRAMMAR_END, "gids": [w.gid for w in done]})

    def abort_request(self, request_id: str, index: int | None = None) -> bool:
        """Abort a request (or one sample) on whichever rank holds it; False if it is not in flight."""
        gid = self.gate.drop(request_id) if index is None else None
        if gid is not None:  # still waiting for its grammar: it never reached a scheduler
            if self.group is not None:
                self.outbox.append({"t": GRAMMAR_END, "gids": [gid]})
            return True
        here = self.core.abort_request(request_id, index)
        if self.group is not None:
            self.outbox.append({"t": ABORT, "rid": request_id, "index": index})
        return here or request_id in self.owner

    def want_stats(self) -> None:
        """The next `step()` also returns every rank's scheduler stats."""
        self.stats_wanted = True
        if self.group is not None:
            self.outbox.append({"t": STATS})

    def stop(self) -> None:
        """Leader: the next `step()` tells the followers to leave their loops."""
        self.stopped = True
        if self.group is not None:
            self.outbox.append({"t": STOP})

    def _route(self) -> int:
        load = [0] * self.world
        for r, _ in self.owner.values():
            load[r] += 1
        return min(range(self.world), key=lambda r: (load[r], r))

    # ---- every rank: one iteration -------------------------------------------------------------
    def step(self) -> tuple[list[TokenDelta], list[dict[str, Any]]]:
        """Share the leader's messages, apply them, agree on pending grammars, step. Returns (deltas, stats): on
        the leader every rank's deltas and, when stats were asked for, every rank's stats; elsewhere ([], [])."""
        if self.is_leader:
            self._settle_grammars()
        sync = self.is_leader and self.gate.busy  # grammars pending: this iteration all-gathers their status
        work = self.is_leader and self.dp and (any(self.busy) or self.core.has_unfinished()
                                               or any(m["t"] in (GENERATE, ABORT) for m in self.outbox))
        msgs, work, sync = self._broadcast(self.outbox, work, sync)
        self.outbox = []
        if not self.is_leader:
            for m in msgs:
                self._apply(m)
        if sync and self.group is not None:
            self._agree()
        want_stats, self.stats_wanted = self.stats_wanted, False
        if not self.dp:
            deltas = self.core.step() if self.core.has_unfinished() else []
            if not self.is_leader:
                return [], []
            return deltas, [self.core.stats()] if want_stats else []
        deltas = self.core.step(idle_forward=True) if work else []
        return self._gather(deltas, want_stats)

    def _apply(self, m: dict[str, Any]) -> None:
        """A follower applies what the leader already applied to itself."""
        kind = m["t"]
        if kind == GENERATE and (not self.dp or m["dest"] == self.rank):
            sampling = SamplingParams.from_dict(m["sampling"])
            self.core.add_request(EngineRequest(m["rid"], list(m["ids"]), sampling, m["arrival"]),
                                  grammar=self.gate.compiled(m.get("gid")))
        elif kind == GRAMMAR:
            self.gate.follow(m["gid"], m["kind"], m["value"])
        elif kind == GRAMMAR_END:
            self.gate.end(m["gids"])
        elif kind == ABORT:
            self.core.abort_request(m["rid"], m.get("index"))
        elif kind == STATS:
            self.stats_wanted = True
        elif kind == STOP:
            self.stopped = True

    def _agree(self) -> None:
        """Every rank's status of the open grammar compiles to the leader (it decides at the next `step()`)."""
        parts = all_gather_bytes(msgpack.packb(self.gate.report(), use_bin_type=True), self.group)
        if self.is_leader:
            for r, data in enumerate(parts[1:], start=1):
                self.gate.record(r, msgpack.unpackb(data, raw=False))

    # ---- collectives over the CPU group -----------------------------------------------------------
    def _broadcast(self, inbox: list[dict[str, Any]], work: bool,
                   sync: bool) -> tuple[list[dict[str, Any]], bool, bool]:
        if self.group is None:
            return [], work, sync
        payload = msgpack.packb([work, sync, inbox], use_bin_type=True) if self.is_leader else b""
        head = self._head
        if self.is_leader:
            _put(head, payload)
        dist.broadcast(head, src=0, group=self.group)
        n = _length(head)
        if n > HEAD_BYTES:  # a big iteration (long prompts): the rest in a second broadcast
            body = torch.zeros(n, dtype=torch.uint8)
            if self.is_leader:
                body.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            dist.broadcast(body, src=0, group=self.group)
            data = bytes(body.numpy())
        else:
            data = bytes(head[8: 8 + n].numpy())
        work, sync, msgs = msgpack.unpackb(data, raw=False)
        return msgs, work, sync

    def _gather(self, deltas: list[TokenDelta], want_stats: bool) -> tuple[list[TokenDelta], list[dict]]:
        mine = {"deltas": [{f: getattr(d, f) for f in TokenDelta.__slots__} for d in deltas],
                "busy": self.core.has_unfinished(), "stats": self.core.stats() if want_stats else None}
        # `plain` only for what msgpack cannot take itself (numpy scalars in stats): token ids pass as they are
        parts = all_gather_bytes(msgpack.packb(mine, use_bin_type=True, default=plain), self.group)
        if not self.is_leader:
            return [], []
        out: list[TokenDelta] = []
        stats: list[dict] = []
        for r, data in enumerate(parts):
            got = msgpack.unpackb(data, raw=False)
            self.busy[r] = got["busy"]
            for d in got["deltas"]:
                delta = TokenDelta(**d)
                out.append(delta)
                if delta.finished:
                    self._sample_done(delta.request_id)
            if got["stats"] is not None:
                stats.append(got["stats"])
        return out, stats

    def _sample_done(self, request_id: str) -> None:
        entry = self.owner.get(request_id)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self.owner[request_id]


def run_follower(group: RankGroup) -> None:
    """A follower rank's whole life after startup: iterations until the leader says stop."""
    while not group.stopped:
        group.step()


def all_gather_bytes(data: bytes, group: Any) -> list[bytes]:
    """Every rank's bytes, in rank order: one fixed-size all-gather, and a second one only when a rank's
    payload did not fit the first."""
    world = dist.get_world_size(group)
    head = torch.zeros(HEAD_BYTES + 8, dtype=torch.uint8)
    _put(head, data)
    heads = [torch.empty_like(head) for _ in range(world)]
    dist.all_gather(heads, head, group=group)
    lengths = [_length(h) for h in heads]
    if max(lengths) <= HEAD_BYTES:
        return [bytes(h[8: 8 + n].numpy()) for h, n in zip(heads, lengths, strict=True)]
    body = torch.zeros(max(lengths), dtype=torch.uint8)
    body[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else body[:0]
    bodies = [torch.empty_like(body) for _ in range(world)]
    dist.all_gather(bodies, body, group=group)
    return [bytes(b[:n].numpy()) for b, n in zip(bodies, lengths, strict=True)]


def _put(head: torch.Tensor, data: bytes) -> None:
    head[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    if 0 < len(data) <= HEAD_BYTES:
        head[8: 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _length(head: torch.Tensor) -> int:
    return int.from_bytes(bytes(head[:8].numpy()), "little")
