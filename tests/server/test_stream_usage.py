"""Streaming a benchmark can time per token: `stream_options.continuous_usage_stats` puts the request's running
usage in every chunk (vLLM's behaviour), and then every output that carries tokens is sent, also when its
text is empty, so each chunk's tokens are the growth of usage.completion_tokens."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.server.harness import MODEL

PROMPT = "The scheduler picks which requests run"
MESSAGES = [{"role": "user", "content": "Say hello."}]
RUNNING = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url, api_key="unused", timeout=60, max_retries=0)


def _growth(chunks) -> list[tuple[int, str, bool]]:
    """(tokens, text, finished) of every chunk with choices: tokens = growth of the running completion count."""
    seen, out = 0, []
    for c in chunks:
        assert c.usage is not None, c  # every chunk carries the running usage
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        grown, seen = c.usage.completion_tokens - seen, c.usage.completion_tokens
        assert grown >= 0
        if c.choices:
            ch = c.choices[0]
            text = ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            out.append((grown, text, ch.finish_reason is not None))
        else:
            assert grown == 0  # the final usage chunk adds nothing
    return out


def test_completion_stream_carries_running_usage_in_every_chunk(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True})
    plain = list(client.completions.create(**args, stream_options={"include_usage": True}))
    chunks = list(client.completions.create(**args, stream_options=RUNNING))
    rows = _growth(chunks)
    assert sum(k for k, _, _ in rows) == 24 == chunks[-1].usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == plain[-1].usage.prompt_tokens
    # every chunk with choices carries tokens (or ends the choice); none is dropped for having no text
    assert all(k >= 1 or done for k, _, done in rows)
    empty = sum(1 for k, text, _ in rows if k and not text)
    assert len(rows) == len([c for c in plain if c.choices]) + empty
    assert "".join(t for _, t, _ in rows) == "".join(c.choices[0].text for c in plain if c.choices)


def test_chat_stream_carries_running_usage_over_all_choices(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, n=2, temperature=1.0,
                                                 seed=3, stream=True, stream_options=RUNNING,
                                                 extra_body={"ignore_eos": True}))
    rows = _growth(chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].usage.completion_tokens == 0
    assert sum(k for k, _, _ in rows) == 20 == chunks[-1].usage.completion_tokens  # request-wide: 2 choices x 10
    assert all(k >= 1 or done or c.choices[0].delta.role for (k, _, done), c in
               zip(rows, [c for c in chunks if c.choices], strict=True))


def test_continuous_usage_needs_include_usage(client):
    """As vLLM: continuous_usage_stats alone sends no usage."""
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True,
                                            stream_options={"continuous_usage_stats": True}))
    assert chunks and all(c.usage is None for c in chunks)
