"""TokenizerManager in-process, over real ZMQ sockets, with a fake scheduler on the other end: the health
probe's verdict, the queue bound against the KV pool, and the drain (no model, no child process)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.server import ipc
from dsaserve.server.protocol import APIError
from dsaserve.server.request_state import GenerateRequest, Prompt
from dsaserve.server.tokenizer_manager import TokenizerManager


class Readiness:
    is_up = True

    def describe(self) -> str:
        return "Up"


class Metrics:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


IDS = itertools.count()
INFO = {"max_running_requests": 128, "num_pages": 8, "page_size": 64, "max_req_input_len": 511,
        "max_model_len": 512, "vocab_size": 512}


@contextlib.asynccontextmanager
async def manager(tmp_path: Path, max_queued: int | None = 4) -> AsyncIterator[tuple[TokenizerManager, Any, Any]]:
    """(tm, the scheduler's PULL socket, a PUSH socket into the main process)."""
    ends = ipc.Endpoints.in_dir(tmp_path)
    tm = TokenizerManager(None, ends, Readiness(), Metrics(), max_queued)
    tm.bind()
    tm.start()
    tm.rx.scheduler_info = dict(INFO)
    ctx = zmq.asyncio.Context()
    sched, to_main = ipc.pull_socket(ctx, ends.sched_in), ipc.push_socket(ctx, ends.main_in)
    try:
        yield tm, sched, to_main
    finally:
        await tm.close()
        ctx.destroy(linger=0)


def request(prompt_len: int = 3, max_tokens: int = 100) -> GenerateRequest:
    return GenerateRequest(f"cmpl-{next(IDS)}", [Prompt(list(range(prompt_len)))],
                           SamplingParams(max_tokens=max_tokens), max_tokens)


async def answer_one(sched: Any, to_main: Any, logprob: float) -> None:
    """The fake engine: finish the next request with one token of this logprob."""
    msg = ipc.unpack(await sched.recv())
    item = {"rid": msg["rid"], "index": 0, "text": "x", "ids": [5], "finished": True, "reason": "length",
            "lps": [{"token": "x", "logprob": logprob, "bytes": [120], "top": []}], "completion_tokens": 1}
    await to_main.send(ipc.pack(ipc.OUTPUTS, items=[item]))


@pytest.mark.parametrize("logprob", [math.nan, math.inf, -math.inf])
def test_the_health_probe_fails_on_non_finite_logits_and_says_so(tmp_path, logprob):
    async def scenario() -> tuple[str | None, str | None]:
        async with manager(tmp_path) as (tm, sched, to_main):
            engine = asyncio.ensure_future(answer_one(sched, to_main, logprob))
            bad = await tm.health(5.0)
            await engine
            tm._health_cache = None
            engine = asyncio.ensure_future(answer_one(sched, to_main, -0.25))
            good = await tm.health(5.0)
            await engine
            return bad, good

    bad, good = asyncio.run(scenario())
    assert bad is not None and "logits are not finite" in bad
    assert good is None


def test_the_queue_bound_counts_kv_pages_not_only_rows(tmp_path):
    """Issue 20.6: 50 requests against 8 pages were all accepted. Each sample here holds up to 2 pages
    (3 prompt + 100 output tokens), so 4 run at once; with --max-queued-requests 4 the 9th gets 429."""

    async def scenario() -> tuple[int, APIError | None]:
        async with manager(tmp_path) as (tm, _, _):
            for accepted in range(50):
                try:
                    tm.check_capacity(request())
                except APIError as e:
                    return accepted, e
                await tm.submit(request())
            return 50, None

    accepted, err = asyncio.run(scenario())
    assert accepted == 8
    assert err is not None and err.status == 429 and err.code == "queue_full"
    assert "4 fit at once" in err.message and err.headers == {"Retry-After": "1"}


def test_rows_still_bound_the_queue_when_the_pool_is_large(tmp_path):
    async def scenario() -> int:
        async with manager(tmp_path, max_queued=2) as (tm, _, _):
            tm.rx.scheduler_info.update(max_running_requests=3, num_pages=10_000)
            for accepted in range(10):
                try:
                    tm.check_capacity(request())
                except APIError:
                    return accepted
                await tm.submit(request())
            return 10

    assert asyncio.run(scenario()) == 3 + 2


def test_a_drain_out_of_time_ends_what_is_left_with_a_503_and_aborts_it(tmp_path):
    async def scenario() -> tuple[int, APIError, list[str]]:
        async with manager(tmp_path) as (tm, sched, _):
            h = await tm.submit(request())
            cut = await tm.drain(0.2)
            with pytest.raises(APIError) as e:
                async for _ in h.results():
                    pass
            kinds = [ipc.unpack(await sched.recv())["t"] for _ in range(2)]
            return cut, e.value, kinds

    cut, err, kinds = asyncio.run(scenario())
    assert cut == 1 and err.status == 503 and "--drain-timeout 0.2 s" in err.message
    assert kinds == [ipc.GENERATE, ipc.ABORT]
