"""Many clients at once: 64 concurrent streams all correct and no KV page leaked; clients that disconnect
mid-request have their requests aborted and their pages freed."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI

from tests.server.harness import MODEL, admin_stats, scrape, value, wait_idle

NUM_CLIENTS = 64
MAX_TOKENS = 24
NEAR_TIE = 1e-3  # logprob gap below which batch-shape float noise may pick the other token (CPU GEMMs differ by M)
_WORDS_TEXT = (
    "the model reads a sequence of tokens and predicts the next one while the scheduler picks which "
    "requests run in the next step and the sampler chooses one token for each"
)
WORDS = tuple(_WORDS_TEXT.split())


def prompt(i: int) -> str:
    return f"Request {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + (i * 5) % 60))


def _tokens_match(got: list[str], ref: list[str], ref_top: list[dict[str, float]], got_lp: list[float]) -> bool:
    """Equal to the reference up to the first position where the two runs met a near-tie (then they may part)."""
    for k, (g, r) in enumerate(zip(got, ref, strict=True)):
        if g != r:
            return g in ref_top[k] and abs(ref_top[k][g] - ref_top[k][r]) < NEAR_TIE and \
                abs(got_lp[k] - ref_top[k][r]) < NEAR_TIE
    return True


async def _stream_one(client: AsyncOpenAI, i: int) -> dict:
    stream = await client.completions.create(model=MODEL, prompt=prompt(i), max_tokens=MAX_TOKENS, temperature=0,
                                             logprobs=2, stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    text, tokens, lps, reasons, usage = "", [], [], [], None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            assert c.index == 0
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
            reasons.append(c.finish_reason)
    return {"text": text, "tokens": tokens, "lps": lps, "reason": [r for r in reasons if r], "usage": usage}


def test_64_concurrent_streams_are_all_correct_and_leak_no_pages(server, tokenizer):
    wait_idle(server)
    # reference: the same 64 prompts in one batched non-streaming request
    ref = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": [prompt(i) for i in range(NUM_CLIENTS)], "max_tokens": MAX_TOKENS,
        "temperature": 0, "logprobs": 2, "ignore_eos": True}).json()["choices"]

    async def run_all() -> list[dict]:
        client = AsyncOpenAI(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0)
        try:
            return await asyncio.gather(*(_stream_one(client, i) for i in range(NUM_CLIENTS)))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    token_id = {tokenizer.token_text(t): t for t in range(tokenizer.vocab_size)}
    exact = 0
    for i, res in enumerate(results):
        assert res["reason"] == ["length"] and res["usage"].completion_tokens == MAX_TOKENS
        assert len(res["tokens"]) == MAX_TOKENS
        # the text is exactly this stream's own tokens, detokenized (no cross-talk, nothing lost)
        assert res["text"] == tokenizer.decode([token_id[t] for t in res["tokens"]])
        r = ref[i]["logprobs"]
        assert _tokens_match(res["tokens"], r["tokens"], r["top_logprobs"], res["lps"]), i
        exact += res["text"] == ref[i]["text"]
    assert exact >= NUM_CLIENTS - 4, f"only {exact} of {NUM_CLIENTS} streams equal the batched reference"
    idle = wait_idle(server)
    assert idle["stats"]["kv_pages_used"] == 0
    assert admin_stats(server, check_leak=True)["leak"] is None
    _, samples = scrape(server)
    assert value(samples, "dsaserve_kv_pages_used") == 0


def test_clients_disconnecting_mid_request_free_their_pages(server):
    wait_idle(server)
    _, before = scrape(server)

    async def stream_then_leave(client: AsyncOpenAI, i: int) -> int:
        stream = await client.completions.create(model=MODEL, prompt=prompt(i), max_tokens=3000, stream=True,
                                                 extra_body={"ignore_eos": True})
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.close()  # hang up mid-stream
        return got

    async def wait_then_leave(i: int) -> None:
        async with httpx.AsyncClient(timeout=0.5) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt(i),
                                                                   "max_tokens": 3000, "ignore_eos": True})

    async def run_all() -> list[int]:
        client = AsyncOpenAI(base_url=server.base_url, api_key="unused", timeout=60, max_retries=0)
        try:
            streams = asyncio.gather(*(stream_then_leave(client, i) for i in range(10)))
            plain = asyncio.gather(*(wait_then_leave(100 + i) for i in range(2)))
            return (await asyncio.gather(streams, plain))[0]
        finally:
            await client.close()

    assert asyncio.run(run_all()) == [3] * 10
    stats = wait_idle(server)["stats"]  # every aborted request has left the scheduler and released its pages
    assert stats["kv_pages_used"] == 0 and stats["num_running"] == 0
    assert admin_stats(server, check_leak=True)["leak"] is None
    _, after = scrape(server)
    aborted = value(after, "dsaserve_requests_aborted_total") - value(before, "dsaserve_requests_aborted_total")
    assert aborted == 12
    engine_aborted = value(after, "dsaserve_engine_aborted_requests_total") - \
        value(before, "dsaserve_engine_aborted_requests_total")
    assert engine_aborted == 12
