"""The HTTP side of `bench serve`: request bodies, one streamed request -> a `Record`, a load run.

Owns: how a request asks for per-token timing and how a chunk's token count is read back.

  --token-counts usage     (default) `stream_options.continuous_usage_stats: true` (vLLM's): the server sends
                           a chunk for every token-carrying output, also when its text is empty, each with
                           the request's running usage; a chunk's tokens are the growth of its cumulative
                           usage.completion_tokens. Costs the engine nothing.
  --token-counts logprobs  completions ask `logprobs: 0`, chat `logprobs: true, top_logprobs: 0`: the server
                           then streams a chunk for every token-carrying output, and each chunk lists its
                           tokens (completions: logprobs.tokens, chat: logprobs.content). For servers without
                           continuous usage; costs the engine a log-softmax per token.

Every request also asks `stream_options.include_usage`; the final usage is the request's token count. A
chunk with text but no count (a server that sends neither) counts as one token and marks the record.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from dsaserve.bench.datasets import BenchRequest
from dsaserve.bench.metrics import Record

TOKEN_COUNTS = ("usage", "logprobs")  # the first is the default
TICK_S = 1.0  # progress refresh while waiting
REQUESTS_METRIC = "dsaserve_requests_received_total"  # prompts the server accepted (the bench sends one a request)


def payload(req: BenchRequest, model: str, endpoint: str, token_counts: str, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "stream": True, "temperature": 0.0,
                            "ignore_eos": ignore_eos,
                            "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": token_counts == "usage"}}
    if endpoint == "completions":
        body["prompt"] = req.prompt
        if token_counts == "logprobs":
            body["logprobs"] = 0
    else:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        if token_counts == "logprobs":
            body |= {"logprobs": True, "top_logprobs": 0}
    return body


def chunk_tokens(choice: dict[str, Any]) -> int | None:
    """Tokens one streamed choice carries, from its logprobs; None when it has none."""
    lp = choice.get("logprobs")
    if not lp:
        return None
    entries = lp.get("tokens") if "tokens" in lp else lp.get("content")
    return len(entries) if entries is not None else None


def _has_text(choice: dict[str, Any]) -> bool:
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


class _Stream:
    """Reads one SSE stream into a Record."""

    def __init__(self, rec: Record, t0: float, on_tokens: Callable[[int], None] | None) -> None:
        self.rec, self.t0, self.on_tokens = rec, t0, on_tokens
        self.usage_tokens = 0  # cumulative usage.completion_tokens seen so far (continuous usage)
        self.final_usage: dict[str, Any] | None = None
        self.done = False

    def line(self, line: str) -> None:
        if not line.startswith("data: "):
            return
        if line == "data: [DONE]":
            self.done = True
            return
        obj = json.loads(line[6:])
        if "error" in obj:
            raise _ServerError(str((obj["error"] or {}).get("message", obj["error"])))
        now = time.perf_counter() - self.t0
        k = self._tokens(obj)
        if k:
            self.rec.chunks.append((now, k))
            if self.on_tokens:
                self.on_tokens(k)

    def _tokens(self, obj: dict[str, Any]) -> int:
        usage = obj.get("usage")
        choices = obj.get("choices") or []
        if usage:
            self.final_usage = usage
            grown = int(usage.get("completion_tokens", 0)) - self.usage_tokens
            self.usage_tokens += grown
            if choices:  # continuous usage: this chunk's tokens are the growth
                self.rec.empty_text_chunks += bool(grown) and not any(_has_text(c) for c in choices)
                return grown
        counts = [chunk_tokens(c) for c in choices]
        if any(c is not None for c in counts):
            self.rec.empty_text_chunks += not any(_has_text(c) for c in choices)
            return sum(c or 0 for c in counts)
        if any(_has_text(c) for c in choices):
            self.rec.counted_by_text = True
            return 1
        return 0

    def finish(self, e2el: float) -> None:
        rec = self.rec
        if not self.done:
            raise _ServerError("the stream ended before [DONE]")
        rec.e2el, rec.ok = e2el, True
        if self.final_usage:
            rec.output_tokens = int(self.final_usage.get("completion_tokens", 0))
            rec.input_len = int(self.final_usage.get("prompt_tokens", rec.input_len))
        else:
            rec.output_tokens = rec.chunk_tokens


class _ServerError(Exception):
    pass


async def send(client: Any, url: str, body: dict[str, Any], req: BenchRequest, headers: dict[str, str],
               on_tokens: Callable[[int], None] | None = None) -> Record:
    """One streamed request. Failed only on an HTTP error, an error event or an exception."""
    rec = Record(input_len=req.input_len, expected_output=req.output_len)
    t0 = time.perf_counter()
    stream = _Stream(rec, t0, on_tokens)
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
                return rec
            async for line in r.aiter_lines():
                stream.line(line)
        stream.finish(time.perf_counter() - t0)
    except _ServerError as e:
        rec.error = str(e)[:300]
    except Exception as e:  # network errors count as failed requests, the run goes on
        rec.error = f"{type(e).__name__}: {e}"[:300]
    return rec


async def run_load(url: str, headers: dict[str, str], work: list[tuple[BenchRequest, dict[str, Any]]], *,
                   request_rate: float, max_concurrency: int | None, seed: int, timeout: float,
                   on_done: Callable[[Record], None] | None = None,
                   on_tokens: Callable[[int], None] | None = None,
                   on_tick: Callable[[], None] | None = None) -> tuple[list[Record], float]:
    """Send every request: Poisson arrivals at request_rate (inf: all at once), at most max_concurrency in
    flight. Returns the records in request order and the run's duration (first send to last end). on_tick
    runs every TICK_S meanwhile (a progress bar's clock keeps moving while nothing arrives)."""
    import random

    import httpx

    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency or len(work) or 1)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def one(req: BenchRequest, body: dict[str, Any]) -> Record:
            async with sem:
                rec = await send(client, url, body, req, headers, on_tokens)
            if on_done:
                on_done(rec)
            return rec

        tasks = []
        ticker = asyncio.ensure_future(_tick(on_tick)) if on_tick else None
        t0 = time.perf_counter()
        for i, (req, body) in enumerate(work):
            tasks.append(asyncio.ensure_future(one(req, body)))
            if request_rate != float("inf") and i + 1 < len(work):
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals, as vLLM
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if ticker:
            ticker.cancel()
        return list(records), duration


async def _tick(fn: Callable[[], None]) -> None:
    while True:
        await asyncio.sleep(TICK_S)
        fn()


def server_info(base: str, headers: dict[str, str]) -> tuple[str, int]:
    """(the first served model, the vocabulary size from /startup, or 1000 when the server has none)."""
    import httpx

    models = httpx.get(base + "/v1/models", headers=headers, timeout=30).raise_for_status().json()["data"]
    try:
        vocab = int(httpx.get(base + "/startup", headers=headers, timeout=30).json()["scheduler_info"]["vocab_size"])
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        vocab = 1000  # a server without the dsaserve manifest: stay inside any real vocabulary
    return models[0]["id"], vocab


def requests_served(base: str, headers: dict[str, str]) -> float | None:
    """The server's count of generation requests accepted so far (/metrics), None when it has none."""
    import httpx

    try:
        text = httpx.get(base + "/metrics", headers=headers, timeout=30).raise_for_status().text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == REQUESTS_METRIC:
            return float(value)
    return None
