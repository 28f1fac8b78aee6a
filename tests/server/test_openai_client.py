"""The real `openai` client against a started server: completions, chat, streaming, n, stop, logprobs, usage."""

from __future__ import annotations

import math

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.server.harness import MODEL, admin_stats, wait_idle

PROMPT = "The scheduler picks which requests run"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url, api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def greedy_text(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    return r.choices[0].text


def _stream_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_completion_returns_text_and_exact_usage(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_renders_the_checkpoint_template_like_transformers(client, tiny_checkpoint):
    hf = AutoTokenizer.from_pretrained(str(tiny_checkpoint(MODEL)))
    text = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    expected_prompt = hf.encode(text, add_special_tokens=False)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=7, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(expected_prompt)
    assert r.usage.completion_tokens == 7


def test_streamed_completion_chunks_reassemble_to_the_non_streamed_text(client, greedy_text):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts, reasons, usage = _stream_text(stream)
    assert texts == {0: greedy_text}
    assert reasons == {0: "length"}
    assert usage.completion_tokens == 24


def test_streamed_chat_reassembles_and_reports_usage_last(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])
    texts, reasons, usage = _stream_text(chunks)
    assert texts == {0: full.choices[0].message.content}
    assert reasons == {0: "length"} and usage.prompt_tokens == full.usage.prompt_tokens


def test_n3_returns_three_choices_and_counts_every_token(client, tokenizer):
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1  # greedy samples of one prompt are one text
    assert greedy.usage.completion_tokens == 72
    assert greedy.usage.prompt_tokens == len(tokenizer.encode(PROMPT))  # the prompt counts once
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, n=3, seed=11)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, n=3, seed=11)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]  # seeded -> reproducible
    assert len({c.text for c in sampled.choices}) > 1  # sample i uses seed + i: not three copies


def test_n3_streaming_keeps_choices_apart(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, n=3, temperature=1.0,
                                          seed=5)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, n=3, temperature=1.0,
                                            seed=5, stream=True, stream_options={"include_usage": True})
    texts, reasons, usage = _stream_text(stream)
    assert texts == {c.index: c.message.content for c in full.choices}
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 36 == full.usage.completion_tokens


def _stop_from(text: str) -> tuple[str, str]:
    """A stop string taken from the middle of a known greedy output, and the text before it."""
    for start in range(4, len(text) - 3):
        stop = text[start:start + 3]
        if stop.strip() and "\ufffd" not in stop:
            return stop, text[: text.find(stop)]
    pytest.fail(f"no usable stop string in {text!r}")


def test_stop_string_cuts_the_output_and_reports_stop(client, greedy_text):
    stop, before = _stop_from(greedy_text)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "@@@@"])
    assert r.choices[0].text == before and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True)
    texts, reasons, _ = _stream_text(stream)
    assert texts == {0: before} and reasons == {0: "stop"}  # nothing of the stop string ever leaked out
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == before + stop


def test_stop_string_with_n3_stops_every_sample(client):
    # a stop string ends each sample on its own (a per-sample abort); a stop string that never matches gives
    # the baseline of exactly that batch shape (greedy texts compared across batch shapes could differ by a
    # float near-tie on the CPU)
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, n=3, stop="@@@@")
    assert len({c.text for c in base.choices}) == 1 and base.choices[0].finish_reason == "length"
    stop, before = _stop_from(base.choices[0].text)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, n=3, stop=stop)
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [(i, before, "stop") for i in range(3)]


def test_n3_with_a_stop_string_shares_the_prompt_pages_and_computes_the_prompt_once(server, client):
    page = server.get("/startup").json()["scheduler_info"]["page_size"]
    prompt = [2 + (37 * k) % 500 for k in range(2 * page + 5)]  # two full pages and a partial one
    max_tokens = 6
    wait_idle(server)
    before = admin_stats(server)["stats"]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, n=3,
                                  stop="@@@@", extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in r.choices] == ["length"] * 3 and r.usage.completion_tokens == 3 * max_tokens
    after = wait_idle(server)["stats"]
    d = {k: after[k] - before[k] for k in ("requests", "prompt_tokens", "computed_tokens", "prefix_cache_hit_tokens")}
    assert d["requests"] == 1 and d["prompt_tokens"] == len(prompt) and d["prefix_cache_hit_tokens"] == 0
    # one engine request: sample 0 computes the prompt and its own tokens; samples 1 and 2 fork from it, sharing
    # its full prompt pages, and compute only the partial last page and their own tokens (not the prompt again).
    # The last sampled token of each sample is never computed.
    partial = len(prompt) % page
    assert d["computed_tokens"] == len(prompt) + (max_tokens - 1) + 2 * (partial + max_tokens - 1)


def test_completion_logprobs_have_one_entry_per_token(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10 == r.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-5)  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)


def _offsets(client, stream: bool, **kw) -> tuple[list[str], list[int]]:
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0, extra_body={"ignore_eos": True},
              **kw)
    if not stream:
        lp = client.completions.create(**kw).choices[0].logprobs
        return lp.tokens, lp.text_offset
    tokens, offsets = [], []
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            tokens += c.logprobs.tokens if c.logprobs else []
            offsets += c.logprobs.text_offset if c.logprobs else []
    return tokens, offsets


@pytest.mark.parametrize("stream", [False, True])
def test_completion_text_offsets_locate_the_tokens_with_a_stop_string_set(client, stream):
    """A stop string that never matches still holds text back while it might start; the offsets follow the
    tokens' text (a whole token's text starts at its offset; a byte-fallback `bytes:` token adds at most a
    character), as without a stop string."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    tokens, offsets = _offsets(client, stream)
    assert len(tokens) == 8 and offsets == sorted(offsets) and offsets[-1] < len(text)
    whole = [(o, t) for o, t in zip(offsets, tokens, strict=True) if not t.startswith("bytes:")]
    assert whole and all(text[o:o + len(t)] == t for o, t in whole)
    assert _offsets(client, stream, stop="@@@@@@@@") == (tokens, offsets)


def test_logit_bias_forces_the_token_it_favours(client):
    def tokens(favoured: int) -> list[str]:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0,
                                      logit_bias={str(favoured): 100}, extra_body={"ignore_eos": True})
        return r.choices[0].logprobs.tokens

    a, b = tokens(42), tokens(43)
    assert len(set(a)) == len(set(b)) == 1 and a[0] != b[0]  # each run is its favoured token, every step


def test_a_vanishing_repetition_penalty_answers_its_limit_not_garbage(client):
    """repetition_penalty=1e-308 is valid (> 0) but 0 in float32: seen positive logits / r overflowed to inf, the
    softmax turned NaN and the sampled request answered token 0 every step. Its limit is deterministic (the best
    seen positive token), so a sampled request must answer what a greedy one does, with finite logprobs."""
    def run(**kw) -> object:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=0, **kw,
                                         extra_body={"ignore_eos": True, "repetition_penalty": 1e-308}
                                         ).choices[0].logprobs

    greedy, sampled = run(temperature=0), run(temperature=1.0, seed=7)
    assert sampled.tokens == greedy.tokens
    assert all(math.isfinite(v) for v in greedy.token_logprobs + sampled.token_logprobs)


def test_chat_logprobs_and_top_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 2 and tok.bytes
        if not tok.token.startswith("bytes:"):  # a whole UTF-8 token: its bytes are its text
            assert tok.bytes == list(tok.token.encode())
        assert math.isclose(tok.logprob, tok.top_logprobs[0].logprob, abs_tol=1e-5)
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[1].logprob
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None


def test_batch_of_prompts_numbers_choices_prompt_major(client, tokenizer):
    prompts = ["Hello, world!", "Question: what is two plus three?"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=1.0, seed=3, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 20


def test_token_id_prompt_and_echo(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert by_text.choices[0].text == PROMPT + by_ids.choices[0].text


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
