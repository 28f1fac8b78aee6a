"""Processor in-process: large texts are tokenized and chat templates rendered off the event loop, and
text is bounded by bytes before any tokenizer work (issue 20.3)."""

from __future__ import annotations

import asyncio
import time

import pytest

from dsaserve.server.processor import OFFLOAD_CHARS, Processor
from dsaserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

SLOW_S = 0.5
INFO = {"max_req_input_len": 100_000, "max_model_len": 100_001, "max_running_requests": 8, "vocab_size": 512}


class SlowTokenizer:
    """Holds the thread for SLOW_S per call, as a real tokenizer does on a multi-megabyte text."""

    vocab_size = 512
    max_token_bytes = 16

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        time.sleep(SLOW_S)
        return [1] * 10

    def apply_chat_template(self, messages: list, **kw) -> str:
        time.sleep(SLOW_S)
        return "rendered: " + messages[-1]["content"]


async def ticks_during(work) -> tuple[object, int]:
    """Run `work` while a 10 ms ticker counts how often the loop gets to run it."""
    count = 0

    async def ticker() -> None:
        nonlocal count
        while True:
            await asyncio.sleep(0.01)
            count += 1

    t = asyncio.ensure_future(ticker())
    try:
        return await work, count
    finally:
        t.cancel()


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_large_texts_are_tokenized_and_rendered_off_the_event_loop(endpoint):
    tok = SlowTokenizer()
    proc = Processor(tok, lambda: INFO)
    text = "x" * (OFFLOAD_CHARS + 1)
    if endpoint == "completion":
        work = proc.completion(CompletionRequest(model="m", prompt=text))
    else:
        work = proc.chat(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": text}]))
    req, ticks = asyncio.run(ticks_during(work))
    assert req.prompts[0].ids == [1] * 10
    expected = SLOW_S * (1 if endpoint == "completion" else 2) / 0.01
    assert ticks >= expected / 4, (ticks, expected)  # the loop kept running meanwhile


def test_text_that_cannot_fit_is_refused_by_its_bytes_without_tokenizing():
    tok = SlowTokenizer()
    proc = Processor(tok, lambda: {**INFO, "max_req_input_len": 100})
    assert proc.max_text_bytes == 100 * 16 * 2
    with pytest.raises(APIError) as e:
        asyncio.run(proc.completion(CompletionRequest(model="m", prompt="é" * 1601)))  # 3202 UTF-8 bytes
    assert e.value.status == 413 and e.value.param == "prompt" and tok.calls == 0


class FastTokenizer(SlowTokenizer):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * 10


@pytest.mark.parametrize(("body", "max_tokens"), [
    ({}, 16),  # OpenAI's default for legacy completions
    ({"max_tokens": None}, INFO["max_model_len"] - 10),  # null: what the context leaves (vLLM's reading)
    ({"max_tokens": 5, "n": None, "stream": None, "echo": None}, 5),  # other nulls: their defaults
])
def test_completion_max_tokens_unset_null_and_given(body, max_tokens):
    req = CompletionRequest.model_validate({"model": "m", "prompt": "hi", **body})
    done = asyncio.run(Processor(FastTokenizer(), lambda: INFO).completion(req))
    assert done.max_tokens == max_tokens and done.sampling.n == 1 and not done.stream
