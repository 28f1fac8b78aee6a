"""Prompt logprobs over the API with the real `openai` client: completions' echo with logprobs (the request
lm-eval-harness's loglikelihood tasks send), vLLM's prompt_logprobs on both endpoints, streamed and not."""

from __future__ import annotations

import math

import httpx
import pytest
from openai import OpenAI

from tests.server.harness import MODEL

PROMPT = "The scheduler picks which requests run, and the model computes their tokens"


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url, api_key="unused", timeout=60, max_retries=0)


def _loglikelihood_request(client, ids: list[int], stream: bool = False):
    """lm-eval-harness's local-completions payload for a loglikelihood request."""
    return client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True,
                                     seed=1234, stream=stream)


def test_echo_with_logprobs_scores_every_prompt_token(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    choice = _loglikelihood_request(client, ids).choices[0]
    lp = choice.logprobs
    n = len(ids) + 1  # the prompt's tokens, then the one generated
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert lp.tokens[:-1] == [tokenizer.token_text(t) for t in ids]
    for tok, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert tok <= 0 and len(top) == 1 and tok <= max(top.values()) + 1e-6
    assert lp.text_offset == sorted(lp.text_offset)
    text = choice.text
    assert text.startswith(tokenizer.decode(ids, skip_special_tokens=False))
    whole = [(o, t) for o, t in zip(lp.text_offset, lp.tokens, strict=True) if not t.startswith("bytes:")]
    assert whole and all(text[o:o + len(t)] == t for o, t in whole)


def test_a_prompt_tokens_logprob_is_its_logprob_when_generated(client, tokenizer):
    """The echo's entry for the prompt's last token equals that token's logprob when the model generates it after
    the rest of the prompt (forced by logit_bias; logprobs are the raw model's)."""
    ids = tokenizer.encode(PROMPT)
    echoed = _loglikelihood_request(client, ids).choices[0].logprobs.token_logprobs[len(ids) - 1]
    forced = client.completions.create(model=MODEL, prompt=ids[:-1], max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(ids[-1]): 100}).choices[0].logprobs
    assert forced.tokens == [tokenizer.token_text(ids[-1])]
    assert math.isclose(echoed, forced.token_logprobs[0], abs_tol=1e-4)


def test_streamed_echo_with_logprobs_equals_the_whole_response(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    whole = _loglikelihood_request(client, ids).choices[0]
    text, tokens, values = "", [], []
    for chunk in _loglikelihood_request(client, ids, stream=True):
        for c in chunk.choices:
            text += c.text
            tokens += c.logprobs.tokens if c.logprobs else []
            values += c.logprobs.token_logprobs if c.logprobs else []
    assert (text, tokens, values) == (whole.text, whole.logprobs.tokens, whole.logprobs.token_logprobs)


def test_vllm_prompt_logprobs_on_completions_and_chat(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    echo = _loglikelihood_request(client, ids).choices[0].logprobs
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) == r.usage.prompt_tokens and plp[0] is None
    for i, entry in enumerate(plp[1:], start=1):
        own = entry[str(ids[i])]
        assert math.isclose(own["logprob"], echo.token_logprobs[i], abs_tol=1e-5)
        assert own["decoded_token"] == tokenizer.token_text(ids[i]) and own["rank"] >= 1
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert 2 <= len(entry) <= 3 and ranked[0]["rank"] == 1  # the token itself and the top two
        assert (own["rank"] == 1) == math.isclose(own["logprob"], ranked[0]["logprob"], abs_tol=1e-6)
    assert r.choices[0].logprobs is None  # prompt_logprobs alone adds no completion logprobs

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == chat.usage.prompt_tokens and entries[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in entries[1:])


def test_prompt_logprobs_out_of_range_is_a_400_naming_the_field(server):
    r = httpx.post(server.base_url + "/completions", json={"model": MODEL, "prompt": PROMPT, "prompt_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
