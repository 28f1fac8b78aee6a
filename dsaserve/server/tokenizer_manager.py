"""TokenizerManager: the main process's side of every request (request path stages 2 and 10).

Owns: admission (the bounded queue: 429 past --max-queued-requests samples beyond what can run at once,
where "at once" is bounded by the page-table rows *and* by the KV pool's pages), sending a
GenerateRequest's engine requests and aborts to the scheduler, the drain after SIGTERM (wait for requests
in flight, then end the rest with an error), stats requests, grammar checks (the scheduler compiles),
and the 1-token health probe (coalesced: one in flight, its result cached HEALTH_CACHE_S, so the open
/health route cannot flood the engine; it fails on non-finite logits as well as on a timeout).
Validation and tokenisation happen before, in the Processor; what comes back is routed by the Receiver.

`n` > 1: one engine request with `n` samples, so they share the prompt's KV pages in the engine (the
prompt is computed once). A stop string ends one sample: the detokenizer aborts just that sample index.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from collections.abc import Iterator
from typing import Any

import zmq
import zmq.asyncio

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.server import ipc
from dsaserve.server.hf_tokenizer import HFTokenizer
from dsaserve.server.protocol import APIError, internal, unavailable
from dsaserve.server.receiver import Receiver
from dsaserve.server.request_state import GenerateRequest, Handle, Prompt

log = logging.getLogger(__name__)

HEALTH_CACHE_S = 1.0  # a probe's result answers every /health call for this long (load balancers poll ~1-10 s)
DRAIN_POLL_S = 0.05
GRAMMAR_SLACK_S = 5.0  # a grammar check waits the scheduler's compile timeout plus this


class TokenizerManager:
    def __init__(self, tokenizer: HFTokenizer, endpoints: ipc.Endpoints, readiness: Any, metrics: Any,
                 max_queued_requests: int | None = None) -> None:
        self.tok = tokenizer  # the Processor's (tokenisation happens before a request reaches the manager)
        self.endpoints = endpoints
        self.readiness = readiness
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.rx = Receiver(readiness, metrics)
        self._qids = itertools.count()
        self._ctx: zmq.asyncio.Context | None = None
        self._recv_task: asyncio.Task | None = None
        self._health_task: asyncio.Task | None = None
        self._health_cache: tuple[float, str | None] | None = None  # (monotonic time, failure) of the last probe

    @property
    def scheduler_info(self) -> dict[str, Any]:
        return self.rx.scheduler_info

    # ---- lifecycle ----------------------------------------------------------------------------
    def bind(self) -> None:
        """Bind main_in before the children start, so their first message cannot be lost."""
        self._ctx = zmq.asyncio.Context()
        self._pull = ipc.pull_socket(self._ctx, self.endpoints.main_in)
        self._to_sched = ipc.push_socket(self._ctx, self.endpoints.sched_in)

    def start(self) -> None:
        self._recv_task = asyncio.get_running_loop().create_task(self.rx.run(self._pull), name="tm-recv")

    async def close(self) -> None:
        for task in (self._health_task, self._recv_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    def fail_all(self, reason: str) -> None:
        """Every pending request ends now with a 503 error (the scheduler or detokenizer is gone)."""
        self.rx.fail_all(unavailable(f"the engine is down: {reason}"))

    # ---- admission ----------------------------------------------------------------------------
    def inflight_samples(self) -> int:
        return sum(len(h.open_samples) for h in self.rx.live())

    def check_capacity(self, req: GenerateRequest) -> None:
        """The bounded queue: 429 once more than --max-queued-requests samples would wait behind those
        that can run at once (FCFS, while page-table rows and KV pool pages last)."""
        if not self.readiness.is_up:
            raise unavailable(f"server is {self.readiness.describe()}; not accepting requests")
        if self.max_queued_requests is None:
            return
        info = self.scheduler_info
        rows, pool = int(info.get("max_running_requests") or 1), int(info.get("num_pages") or 1 << 62)
        page_size = int(info.get("page_size") or 1)
        pages = [*self._inflight_pages(page_size), *req.pages_per_sample(page_size)]
        at_once = _fit_at_once(pages, rows, pool)
        if len(pages) > at_once + self.max_queued_requests:
            raise APIError(429, f"server is at capacity: {len(pages) - req.num_samples} samples in flight, of "
                           f"which {at_once} fit at once ({rows} rows, {pool} KV pages), and at most "
                           f"--max-queued-requests {self.max_queued_requests} may wait",
                           "rate_limit_error", None, "queue_full", headers={"Retry-After": "1"})

    def _inflight_pages(self, page_size: int) -> Iterator[int]:
        for h in self.rx.live():
            for rid, _ in sorted(h.open_samples):
                yield -(-(h.subs[rid][1] + h.req.max_tokens) // page_size)

    # ---- sending ------------------------------------------------------------------------------
    async def submit(self, req: GenerateRequest) -> Handle:
        """Send the engine requests of one GenerateRequest (one per prompt, n samples each)."""
        h = Handle(req)
        for p_idx, (rid, fields) in enumerate(req.engine_requests()):
            self.rx.track(h, rid, p_idx)
            await self._to_sched.send(ipc.pack(ipc.GENERATE, rid=rid, arrival_time=time.time(), **fields))
        if not req.internal:
            self.metrics.request_started(len(req.prompts), sum(len(p.ids) for p in req.prompts))
        return h

    async def abort(self, h: Handle) -> None:
        """Abort whatever of h is still running (client gone, or an error); idempotent."""
        rids = {rid for rid, _ in h.open_samples}
        h.open_samples.clear()
        for rid in rids:
            if self.rx.forget(rid):
                with contextlib.suppress(zmq.ZMQError):
                    await self._to_sched.send(ipc.pack(ipc.ABORT, rid=rid))
        if rids and not h.internal:
            self.metrics.request_aborted()

    async def drain(self, timeout: float) -> int:
        """After SIGTERM: wait up to `timeout` s for client requests in flight, then end each one left with
        a 503 error object (a stream: an SSE error event and [DONE]). Returns how many were cut."""
        deadline = time.monotonic() + timeout
        while self.rx.live() and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = self.rx.live()
        err = unavailable(f"the server is shutting down: this request did not finish within --drain-timeout "
                          f"{timeout:g} s")
        for h in left:
            await self.abort(h)
            h.queue.put_nowait(err)
        return len(left)

    # ---- stats and health ---------------------------------------------------------------------
    async def get_stats(self, timeout: float = 2.0, check_leak: bool = False) -> dict[str, Any]:
        """A fresh stats snapshot from the scheduler (its last one if it does not answer in time)."""
        if not self.readiness.is_up:
            return self.rx.last_stats
        try:
            return await self._ask(self.rx.stats_waiters, ipc.STATS_REQ, timeout, check_leak=check_leak)
        except (TimeoutError, APIError):
            if check_leak:
                raise internal("the scheduler did not answer the stats request in time") from None
            return self.rx.last_stats

    async def check_grammar(self, spec: dict[str, str]) -> str | None:
        """None once the scheduler has compiled this structured-output grammar (cached there), else why not.
        The scheduler compiles off its loop and enforces --grammar-compile-timeout itself."""
        timeout = float(self.scheduler_info.get("grammar_compile_timeout") or 10.0) + GRAMMAR_SLACK_S
        try:
            return await self._ask(self.rx.grammar_waiters, ipc.GRAMMAR_CHECK, timeout, spec=spec)
        except TimeoutError:
            return f"the grammar was not compiled within {timeout:g} s"

    async def _ask(self, waiters: dict[int, asyncio.Future], kind: str, timeout: float, **fields: Any) -> Any:
        """Send a `kind` question with a fresh qid; its answer (the Receiver resolves `waiters[qid]`)."""
        qid = next(self._qids)
        fut = asyncio.get_running_loop().create_future()
        waiters[qid] = fut
        await self._to_sched.send(ipc.pack(kind, qid=qid, **fields))
        try:
            return await asyncio.wait_for(fut, timeout)
        except BaseException:
            waiters.pop(qid, None)
            raise

    async def health(self, timeout: float) -> str | None:
        """None when healthy, else why not; coalesced: at most one probe in flight (every caller meanwhile
        awaits it) and its result reused for HEALTH_CACHE_S, so a flood of open /health calls costs the
        engine at most one 1-token request per HEALTH_CACHE_S."""
        if self._health_cache is not None and time.monotonic() - self._health_cache[0] < HEALTH_CACHE_S:
            return self._health_cache[1]
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._health_once(timeout),
                                                                       name="tm-health")
        # shield: a caller that goes away (client disconnect) must not cancel the probe the others await
        return await asyncio.shield(self._health_task)

    async def _health_once(self, timeout: float) -> str | None:
        try:
            failure = await self.health_probe(timeout)
        except Exception as e:  # the probe could not even be sent: unhealthy, not a 500
            log.exception("health probe failed")
            failure = f"the 1-token probe could not be sent: {type(e).__name__}"
        self._health_cache = (time.monotonic(), failure)
        return failure

    async def health_probe(self, timeout: float) -> str | None:
        """A real 1-token request (input_ids=[0], max_new_tokens=1, with its logprob) through the whole loop.

        Passes when it finishes in time with a finite logprob, or when any output arrives meanwhile
        (SGLang's rule: under load the probe queues behind real work, and outputs flowing prove the loop
        is alive). A non-finite logprob means the model's logits are NaN or Inf: unhealthy."""
        t0 = time.monotonic()
        req = GenerateRequest(f"health-{uuid.uuid4().hex}", [Prompt([0])],
                              SamplingParams(max_tokens=1, temperature=0.0, logprobs=0), 1, logprobs=True,
                              internal=True)
        h = await self.submit(req)
        self.metrics.health_probe_sent()
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        async with asyncio.timeout(0.05):
                            got = await h.queue.get()
                    except TimeoutError:
                        if self.rx.last_output_time > t0:
                            return None
                        continue
                    if isinstance(got, APIError):
                        return f"the 1-token probe failed: {got.message}"
                    if got[1]["finished"]:
                        return _probe_verdict(got[1])
        except TimeoutError:
            return f"the 1-token probe did not return within {timeout:g} s"
        finally:
            await self.abort(h)


def _probe_verdict(item: dict[str, Any]) -> str | None:
    for e in item.get("lps") or []:
        if not math.isfinite(float(e["logprob"])):
            return f"the model's logits are not finite (the 1-token probe's logprob is {e['logprob']})"
    return None


def _fit_at_once(pages: list[int], rows: int, pool: int) -> int:
    """How many of these samples, in order, run together before rows or pool pages run out."""
    used = 0
    for count, p in enumerate(pages):
        if count == rows or used + p > pool:
            return count
        used += p
    return len(pages)
