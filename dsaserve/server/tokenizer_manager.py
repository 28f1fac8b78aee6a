"""TokenizerManager: the main process's side of every request (request path stages 1, 2 and 10).

Owns: tokenisation (prompt text, chat template), the state of every in-flight HTTP request (its engine
sub-requests, one asyncio queue their outputs arrive on, timings for the metrics), sending requests and
aborts to the scheduler, receiving the detokenizer's outputs and the scheduler's control messages
(ready, stats, reject, fatal), the 1-token health probe (coalesced: one in flight, its result cached
HEALTH_CACHE_S, so the open /health route cannot flood the engine), and failing everything pending when
the server goes Down.

`n` > 1: one engine request with `n` samples, so they share the prompt's KV pages in the engine (the
prompt is computed once). A stop string ends one sample: the detokenizer aborts just that sample index.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.engine.incremental_detokenizer import PROMPT_CONTEXT
from dsaserve.server import ipc
from dsaserve.server.hf_tokenizer import HFTokenizer
from dsaserve.server.protocol import APIError, bad_request, internal, unavailable

log = logging.getLogger(__name__)

OFFLOAD_CHARS = 1 << 16  # texts longer than this are tokenized in a worker thread (~ms of work)
HEALTH_CACHE_S = 1.0  # a probe's result answers every /health call for this long (load balancers poll ~1-10 s)


@dataclass
class SampleTiming:
    first: float | None = None  # monotonic time of the first output token
    last: float | None = None
    tokens: int = 0


@dataclass
class Handle:
    """One HTTP request: its engine sub-requests and the queue their outputs arrive on."""

    id: str
    arrival: float  # monotonic
    internal: bool = False
    prompt_tokens: dict[str, int] = field(default_factory=dict)  # rid -> its prompt's length (TTFT by shape)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    subs: dict[str, tuple[int, int]] = field(default_factory=dict)  # rid -> (first choice index, n)
    open_samples: set[tuple[str, int]] = field(default_factory=set)
    timing: dict[tuple[str, int], SampleTiming] = field(default_factory=dict)

    def choice(self, rid: str, index: int) -> int:
        return self.subs[rid][0] + index

    @property
    def num_samples(self) -> int:
        return sum(n for _, n in self.subs.values())


@dataclass
class Prompt:
    ids: list[int]
    text: str | None = None  # for echo


class TokenizerManager:
    def __init__(self, tokenizer: HFTokenizer, endpoints: ipc.Endpoints, readiness: Any, metrics: Any,
                 max_queued_requests: int | None = None) -> None:
        self.tok = tokenizer
        self.endpoints = endpoints
        self.readiness = readiness
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.scheduler_info: dict[str, Any] = {}
        self.handles: dict[str, Handle] = {}  # engine rid -> handle
        self.last_output_time = 0.0
        self.last_stats: dict[str, Any] = {}
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._qids = itertools.count()
        self._ctx: zmq.asyncio.Context | None = None
        self._recv_task: asyncio.Task | None = None
        self._health_task: asyncio.Task | None = None
        self._health_cache: tuple[float, bool] | None = None  # (monotonic time, result) of the last probe

    # ---- lifecycle ----------------------------------------------------------------------------
    def bind(self) -> None:
        """Bind main_in before the children start, so their first message cannot be lost."""
        self._ctx = zmq.asyncio.Context()
        self._pull = ipc.pull_socket(self._ctx, self.endpoints.main_in)
        self._to_sched = ipc.push_socket(self._ctx, self.endpoints.sched_in)

    def start(self) -> None:
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop(), name="tm-recv")

    async def close(self) -> None:
        for task in (self._health_task, self._recv_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    # ---- tokenisation -------------------------------------------------------------------------
    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of text; a long text is encoded off the event loop (tokenizers releases the GIL), so
        one huge prompt does not stall every other stream."""
        if len(text) < OFFLOAD_CHARS:
            return self.tok.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.tok.encode, text, add_special_tokens)

    async def encode_text(self, text: str, param: str) -> Prompt:
        if not text:
            raise bad_request(f"{param}: must not be empty", param)
        return Prompt(await self.encode(text, True), text)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (the scheduler's word once Up; the tokenizer's before)."""
        return int(self.scheduler_info.get("vocab_size") or self.tok.vocab_size)

    def check_ids(self, ids: list[int], param: str, allow_empty: bool = False) -> None:
        """400 naming `param` if ids is empty (unless allowed) or holds an id outside [0, vocab)."""
        vocab = self.vocab_size
        if not ids and not allow_empty:
            raise bad_request(f"{param}: must not be empty", param)
        bad = next((t for t in ids if t < 0 or t >= vocab), None)
        if bad is not None:
            raise bad_request(f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param)

    def check_n(self, n: int) -> None:
        """n samples of one prompt run together in the engine, so n may not exceed max_running_requests
        (the scheduler would reject it only after a stream's 200)."""
        running = int(self.scheduler_info.get("max_running_requests") or 0)
        if running and n > running:
            raise bad_request(f"n: {n} samples exceed this server's --max-running-requests of {running}", "n")

    def check_lengths(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        """Same ruler as the scheduler: max_req_input_len for the prompt, the context for prompt + output.

        Returns the max_tokens to use (None -> what is left of the context)."""
        info = self.scheduler_info
        limit = int(info["max_req_input_len"])
        context = min(int(info.get("max_model_len") or limit + 1), int(info.get("max_total_tokens") or 1 << 62))
        if prompt_len > limit:
            raise bad_request(f"{param}: the prompt has {prompt_len} tokens, more than this server's "
                              f"max_req_input_len of {limit}", param, "context_length_exceeded")
        if max_tokens is None:
            return context - prompt_len
        if prompt_len + max_tokens > context:
            raise bad_request(f"max_tokens: {prompt_len} prompt tokens + {max_tokens} max_tokens exceed the "
                              f"context of {context} tokens", "max_tokens", "context_length_exceeded")
        return max_tokens

    # ---- admission ----------------------------------------------------------------------------
    def inflight_samples(self) -> int:
        return sum(len(h.open_samples) for h in {id(h): h for h in self.handles.values()}.values()
                   if not h.internal)

    def check_capacity(self, new_samples: int) -> None:
        """The bounded queue: past max_running_requests + max_queued_requests samples, 429."""
        if not self.readiness.is_up:
            raise unavailable(f"server is {self.readiness.describe()}; not accepting requests")
        if self.max_queued_requests is None:
            return
        running = int(self.scheduler_info.get("max_running_requests") or 0)
        bound = running + self.max_queued_requests
        if self.inflight_samples() + new_samples > bound:
            raise APIError(429, f"server is at capacity: {bound} samples running or queued "
                           f"(max_running_requests {running} + --max-queued-requests {self.max_queued_requests})",
                           "rate_limit_error", None, "queue_full", headers={"Retry-After": "1"})

    async def submit(self, prompts: list[Prompt], sampling: SamplingParams, *, request_id: str | None = None,
                     internal_: bool = False, logprobs: bool = False) -> Handle:
        """Send the engine requests of one HTTP request; choices are numbered prompt-major, n per prompt."""
        h = Handle(request_id or uuid.uuid4().hex, time.monotonic(), internal_)
        n = sampling.n
        detok = {"stop": list(sampling.stop), "include_stop_str_in_output": sampling.include_stop_str_in_output,
                 "skip_special_tokens": sampling.skip_special_tokens, "logprobs": logprobs}
        for p_idx, prompt in enumerate(prompts):
            rid = f"{h.id}-{p_idx}"
            self._register(h, rid, p_idx * n, n)
            h.prompt_tokens[rid] = len(prompt.ids)
            await self._to_sched.send(ipc.pack(ipc.GENERATE, rid=rid, input_ids=prompt.ids, sampling=sampling.to_dict(),
                                               detok={"prompt_tail": prompt.ids[-PROMPT_CONTEXT:], **detok},
                                               arrival_time=time.time()))
        if not internal_:
            self.metrics.request_started(len(prompts), sum(len(p.ids) for p in prompts))
        return h

    def _register(self, h: Handle, rid: str, base: int, n: int) -> None:
        h.subs[rid] = (base, n)
        for i in range(n):
            h.open_samples.add((rid, i))
            h.timing[(rid, i)] = SampleTiming()
        self.handles[rid] = h

    async def outputs(self, h: Handle) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """(choice index, detokenizer item) until every sample finished; APIError if the engine failed."""
        while h.open_samples or not h.queue.empty():
            item = await h.queue.get()
            if isinstance(item, APIError):
                raise item
            yield item

    async def abort(self, h: Handle) -> None:
        """Abort whatever of h is still running (client gone, or an error); idempotent."""
        rids = {rid for rid, _ in h.open_samples}
        h.open_samples.clear()
        for rid in rids:
            if self.handles.pop(rid, None) is not None:
                with contextlib.suppress(zmq.ZMQError):
                    await self._to_sched.send(ipc.pack(ipc.ABORT, rid=rid))
        if rids and not h.internal:
            self.metrics.request_aborted()

    # ---- receiving ----------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                msg = ipc.unpack(data)
                self._dispatch(msg)
            except Exception:  # one bad message must not stop every request's output
                log.exception("tokenizer manager: failed to handle a message")

    def _dispatch(self, msg: dict[str, Any]) -> None:
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
            fut = self._stats_waiters.pop(msg["qid"], None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif kind == ipc.REJECT:
            h = self.handles.get(msg["rid"])
            if h is not None:
                self._close_sub(h, msg["rid"])
                h.queue.put_nowait(bad_request(msg.get("message", "rejected by the scheduler")))
        elif kind == ipc.FATAL:
            self.readiness.mark_down(f"{msg.get('who')} failed: {msg.get('message', '')}")

    def _close_sub(self, h: Handle, rid: str) -> None:
        self.handles.pop(rid, None)
        h.open_samples = {s for s in h.open_samples if s[0] != rid}

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
                    self.metrics.observe_ttft(now - h.arrival, h.prompt_tokens.get(rid))
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

    # ---- Down ---------------------------------------------------------------------------------
    def fail_all(self, reason: str) -> None:
        """Every pending request ends now with a 503 error (the scheduler or detokenizer is gone)."""
        err = unavailable(f"the engine is down: {reason}")
        for h in {id(h): h for h in self.handles.values()}.values():
            h.open_samples.clear()
            h.queue.put_nowait(err)
        self.handles.clear()
        for fut in self._stats_waiters.values():
            if not fut.done():
                fut.set_exception(err)
        self._stats_waiters.clear()

    # ---- stats and health ---------------------------------------------------------------------
    async def get_stats(self, timeout: float = 2.0, check_leak: bool = False) -> dict[str, Any]:
        """A fresh stats snapshot from the scheduler (its last one if it does not answer in time)."""
        if not self.readiness.is_up:
            return self.last_stats
        qid = next(self._qids)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters[qid] = fut
        await self._to_sched.send(ipc.pack(ipc.STATS_REQ, qid=qid, check_leak=check_leak))
        try:
            return await asyncio.wait_for(fut, timeout)
        except (TimeoutError, APIError):
            self._stats_waiters.pop(qid, None)
            if check_leak:
                raise internal("the scheduler did not answer the stats request in time") from None
            return self.last_stats

    async def health(self, timeout: float) -> bool:
        """The health probe's result, coalesced: at most one probe in flight (every caller meanwhile awaits
        it) and its result reused for HEALTH_CACHE_S, so a flood of open /health calls costs the engine
        at most one 1-token request per HEALTH_CACHE_S."""
        if self._health_cache is not None and time.monotonic() - self._health_cache[0] < HEALTH_CACHE_S:
            return self._health_cache[1]
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._health_once(timeout),
                                                                       name="tm-health")
        # shield: a caller that goes away (client disconnect) must not cancel the probe the others await
        return await asyncio.shield(self._health_task)

    async def _health_once(self, timeout: float) -> bool:
        try:
            ok = await self.health_probe(timeout)
        except Exception:  # the probe could not even be sent: unhealthy, not a 500
            log.exception("health probe failed")
            ok = False
        self._health_cache = (time.monotonic(), ok)
        return ok

    async def health_probe(self, timeout: float) -> bool:
        """A real 1-token request (input_ids=[0], max_new_tokens=1) through the whole loop.

        Passes when it finishes in time, or when any output arrives meanwhile (SGLang's rule: under load
        the probe queues behind real work, and outputs flowing prove the loop is alive)."""
        t0 = time.monotonic()
        sampling = SamplingParams(max_tokens=1, temperature=0.0)
        h = await self.submit([Prompt([0])], sampling, request_id=f"health-{uuid.uuid4().hex}", internal_=True)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        async with asyncio.timeout(0.05):
                            item = await h.queue.get()
                    except TimeoutError:
                        if self.last_output_time > t0:
                            return True
                        continue
                    if isinstance(item, APIError):
                        return False
                    if item[1]["finished"]:
                        return True
        except TimeoutError:
            return False
        finally:
            await self.abort(h)
