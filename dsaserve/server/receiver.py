"""Receiver: the main process's receive loop (request path stage 10, and the readiness reports).

Owns: the table of requests in flight (engine rid -> Handle), and everything that arrives on the main
PULL socket — the detokenizer's outputs (routed to their Handle's queue, with TTFT / inter-token / end
-to-end timings for the metrics), `ready` (scheduler_info), `stats` and `grammar_result` answers,
`reject` and `fatal` — and ending every pending request with one error (the engine went Down, or a drain
ran out of time).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import zmq.asyncio

from dsaserve.server import ipc
from dsaserve.server.protocol import APIError, bad_request
from dsaserve.server.request_state import Handle

log = logging.getLogger(__name__)


class Receiver:
    def __init__(self, readiness: Any, metrics: Any) -> None:
        self.readiness = readiness
        self.metrics = metrics
        self.handles: dict[str, Handle] = {}  # engine rid -> handle, in arrival order
        self.scheduler_info: dict[str, Any] = {}
        self.last_output_time = 0.0
        self.last_stats: dict[str, Any] = {}
        self.stats_waiters: dict[int, asyncio.Future] = {}
        self.grammar_waiters: dict[int, asyncio.Future] = {}  # qid -> None (compiled) or the reason

    # ---- the table ----------------------------------------------------------------------------
    def track(self, h: Handle, rid: str, prompt_index: int) -> None:
        h.register(rid, prompt_index)
        self.handles[rid] = h

    def forget(self, rid: str) -> bool:
        return self.handles.pop(rid, None) is not None

    def live(self) -> list[Handle]:
        """Requests in flight from clients (not the health probe), in arrival order."""
        return [h for h in {id(h): h for h in self.handles.values()}.values() if not h.internal]

    def fail_all(self, err: APIError) -> None:
        """Every pending request ends now with `err` (engine Down, or a drain out of time)."""
        for h in {id(h): h for h in self.handles.values()}.values():
            h.open_samples.clear()
            h.queue.put_nowait(err)
        self.handles.clear()
        for fut in [*self.stats_waiters.values(), *self.grammar_waiters.values()]:
            if not fut.done():
                fut.set_exception(err)
        self.stats_waiters.clear()
        self.grammar_waiters.clear()

    # ---- the loop -----------------------------------------------------------------------------
    async def run(self, pull: zmq.asyncio.Socket) -> None:
        while True:
            data = await pull.recv()
            try:
                self.dispatch(ipc.unpack(data))
            except Exception:  # one bad message must not stop every request's output
                log.exception("tokenizer manager: failed to handle a message")

    def dispatch(self, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == ipc.OUTPUTS:
            self.last_output_time = time.monotonic()
            for item in msg["items"]:
                self._on_output(item)
        elif kind == ipc.READY:
            if msg["who"] == "scheduler":
                self.scheduler_info = msg.get("info") or {}
            self.readiness.mark_ready(msg["who"], msg.get("info") or {})
        elif kind == ipc.STATS:
            self.last_stats = msg
            fut = self.stats_waiters.pop(msg["qid"], None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif kind == ipc.GRAMMAR_RESULT:
            fut = self.grammar_waiters.pop(msg["qid"], None)
            if fut is not None and not fut.done():
                fut.set_result(msg.get("error"))
        elif kind == ipc.REJECT:
            h = self.handles.pop(msg["rid"], None)
            if h is not None:
                h.close_sub(msg["rid"])
                h.queue.put_nowait(bad_request(msg.get("message", "rejected by the scheduler")))
        elif kind == ipc.FATAL:
            self.readiness.mark_down(f"{msg.get('who')} failed: {msg.get('message', '')}", msg.get("cause"))

    def _on_output(self, item: dict[str, Any]) -> None:
        rid, index = item["rid"], item.get("index", 0)
        h = self.handles.get(rid)
        if h is None or (rid, index) not in h.open_samples:
            return  # aborted by us, or a late delta
        now = time.monotonic()
        t = h.timing[(rid, index)]
        if item["ids"]:
            if t.first is None:
                t.first = now
                if not h.internal:
                    self.metrics.observe_ttft(now - h.arrival, h.subs[rid][1])
            elif not h.internal:
                self.metrics.observe_itl((now - t.last) / len(item["ids"]))
            t.last = now
            t.tokens += len(item["ids"])
        if item["finished"]:
            h.open_samples.discard((rid, index))
            if not any(s[0] == rid for s in h.open_samples):
                self.handles.pop(rid, None)
            if not h.internal:
                self.metrics.sample_finished(item.get("reason"), now - h.arrival, t)
        h.queue.put_nowait((h.choice(rid, index), item))
