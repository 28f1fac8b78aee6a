"""The grammar gate: structured-output compiles wait off the step loop, and every rank agrees before a request
is admitted (request path stages 2-3; engine/rank_group.py drives it, docs/PARALLELISM.md "Grammars").

Owns: the compiles a rank is waiting for, each under a gate id (`gid`) the leader hands out. The leader opens
an entry per structured request (parked here, outside the core) and per grammar check (the server's 400
before the response starts), parsing its spec once; the spec's canonical form travels to the other ranks in a
`grammar` message, and each of them submits the same compile to its own cache at once (a follower never
compiles inside its step loop). While entries are open the ranks all-gather their status (pending / compiled /
the error) each iteration, and the leader alone decides, on its own clock:

  compiled on every rank   -> admitted: the request goes to the ranks in the same iteration's messages, so
                              every TP rank adds it at the same step and forms the same batches;
  failed on any rank       -> rejected everywhere with that rank's reason (xgrammar is deterministic over
                              one vocabulary, so in practice every rank fails alike);
  past the compile timeout -> rejected everywhere; the spec is cached as failed on the leader, so later
                              requests with it fail at once (the stuck thread runs on: xgrammar cannot stop).

A follower only follows: it opens what the leader opened, reports, and drops an entry when told (`end`).
With one rank there is nothing to agree on: an entry settles as soon as its own compile does.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dsaserve.engine.grammar import GrammarError, GrammarSpec

PENDING, OK = 0, 1  # a rank's status of an entry; any other status is the error text


@dataclass
class Wait:
    gid: int
    spec: GrammarSpec | None
    fut: Future | None
    t0: float  # leader: when it opened (the timeout runs from here)
    rid: str | None = None  # a parked request's id (None: a check)
    qid: Any = None  # a check's query id
    request: tuple | None = None  # (prompt, sampling, arrival_time) of a parked request
    error: str | None = None  # set when it failed (parse, compile, timeout, or another rank's word)
    ranks: dict[int, Any] = field(default_factory=dict)  # leader: each other rank's last reported status

    def status(self) -> int | str:
        if self.error is not None:
            return self.error
        if not self.fut.done():
            return PENDING
        exc = self.fut.exception()
        return OK if exc is None else str(exc)

    @property
    def compiled(self) -> Any:
        return self.fut.result()


class GrammarGate:
    """One rank's open compiles; the leader also decides (`settle`)."""

    def __init__(self, core: Any, world: int = 1) -> None:
        self.core = core
        self.world = world
        self.timeout = float(core.args.grammar_compile_timeout)
        self.entries: dict[int, Wait] = {}
        self.parked: dict[str, Wait] = {}  # leader: rid -> its entry
        self._next_gid = 0

    @property
    def busy(self) -> bool:
        return bool(self.entries)

    def open(self, spec_dict: Any, rid: str | None = None, qid: Any = None, request: tuple | None = None) -> Wait:
        """Leader: parse the spec (the only time it is parsed) and submit its compile; a spec refused before
        any compile gets an entry with `error` already set."""
        gid, self._next_gid = self._next_gid, self._next_gid + 1
        w = Wait(gid, None, None, time.monotonic(), rid, qid, request)
        try:
            w.spec = GrammarSpec.from_dict(spec_dict if isinstance(spec_dict, dict) else {})
            w.fut = self.core.grammars.submit(w.spec)
        except (GrammarError, ValueError) as e:
            w.error = str(e)
        self.entries[gid] = w
        if rid is not None:
            self.parked[rid] = w
        return w

    def follow(self, gid: int, kind: str, value: str) -> None:
        """Follower: the leader opened `gid`; start the same compile here (canonical text: no parse)."""
        w = Wait(gid, GrammarSpec(kind, value), None, time.monotonic())
        try:
            w.fut = self.core.grammars.submit(w.spec)
        except ValueError as e:  # no tokenizer: the leader refused it already, but never die of it here
            w.error = str(e)
        self.entries[gid] = w

    def compiled(self, gid: int | None) -> tuple[GrammarSpec, Any] | None:
        """Follower: (spec, compiled grammar) of an admitted request's entry — compiled here, since this rank
        reported it so before the leader admitted it."""
        w = self.entries.get(gid) if gid is not None else None
        return (w.spec, w.compiled) if w is not None and w.status() == OK else None

    def end(self, gids: list[int]) -> None:
        for gid in gids:
            w = self.entries.pop(gid, None)
            if w is not None and w.rid is not None:
                self.parked.pop(w.rid, None)

    def drop(self, rid: str) -> int | None:
        """Leader: forget a parked request (aborted); its gid, for the other ranks to drop too."""
        w = self.parked.pop(rid, None)
        if w is None:
            return None
        self.entries.pop(w.gid, None)
        return w.gid

    # ---- the agreement -----------------------------------------------------------------------
    def report(self) -> list[list[Any]]:
        """This rank's [gid, status] of every open entry (what the all-gather carries)."""
        return [[gid, w.status()] for gid, w in self.entries.items()]

    def record(self, rank: int, report: list[list[Any]]) -> None:
        """Leader: another rank's report."""
        for gid, status in report:
            w = self.entries.get(gid)
            if w is not None:
                w.ranks[rank] = status

    def settle(self) -> list[Wait]:
        """Leader: the entries decided now (removed; `error` set on those rejected), in the order opened."""
        now = time.monotonic()
        done = [w for w in self.entries.values() if self._decided(w, now)]
        self.end([w.gid for w in done])
        return done

    def _decided(self, w: Wait, now: float) -> bool:
        mine = w.status()
        others = [w.ranks.get(r, PENDING) for r in range(1, self.world)]
        failed = next((s for s in [mine, *others] if s not in (PENDING, OK)), None)
        if failed is not None:
            w.error = failed
            return True
        if mine == OK and all(s == OK for s in others):
            return True
        if now - w.t0 < self.timeout:
            return False
        reason = f"compiling took longer than {self.timeout:g} s"
        self.core.grammars.fail(w.spec, reason)  # later requests with this spec fail at once
        w.error = f"{w.spec.kind}: {reason}"
        return True
