"""Bad input gets the right status and an OpenAI error object before any model work; the server keeps
serving. Also: API key (401), the bounded queue (429 + Retry-After, decided before a stream's 200), and
n past --max-running-requests (400, also decided before a stream's 200)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from openai import OpenAI, RateLimitError

from dsaserve.config import load_config
from dsaserve.server.protocol import MAX_ERROR_CHARS
from tests.server.harness import MODEL, admin_stats

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_MSGS = [{"role": "user", "content": "hi"}]
VOCAB = load_config(MODEL).vocab_size
MAX_SEED = (1 << 63) - 1
DEEP = 100_000  # nesting levels: far past json's recursion limit, far under the 8 MiB body cap


def comp(**kw):
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": OK_MSGS, "max_tokens": 4, **kw}


# (case id, path, body (dict -> JSON, bytes/str -> raw), status, expected param or None, expected code or None)
CASES = [
    ("invalid_json", C, b'{"model": "glm-5.3-tiny", "prompt": ', 400, None, None),
    ("not_utf8", C, b"\xff\xfe{}", 400, None, None),
    ("body_is_a_list", C, b"[1, 2, 3]", 400, None, None),
    ("missing_model", C, {"prompt": "hi"}, 400, "model", None),
    ("unknown_model", C, comp(model="gpt-4o"), 404, "model", "model_not_found"),
    ("prompt_wrong_type", C, comp(prompt=42), 400, "prompt", None),
    ("prompt_missing", C, {"model": MODEL}, 400, "prompt", None),
    ("empty_prompt", C, comp(prompt=""), 400, "prompt", None),
    ("empty_prompt_list", C, comp(prompt=[]), 400, "prompt", None),
    ("token_id_outside_vocab", C, comp(prompt=[5, 6, 100000]), 400, "prompt", None),
    ("prompt_over_max_req_input_len", C, comp(prompt=[7] * 4096), 400, "prompt", "context_length_exceeded"),
    ("max_tokens_zero", C, comp(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens_negative", C, comp(max_tokens=-3), 400, "max_tokens", None),
    ("max_tokens_over_context", C, comp(max_tokens=5000), 400, "max_tokens", "context_length_exceeded"),
    ("max_tokens_string", C, comp(max_tokens="ten"), 400, "max_tokens", None),
    ("n_zero", C, comp(n=0), 400, "n", None),
    ("n_too_large", C, comp(n=1000), 400, "n", None),
    ("temperature_too_high", C, comp(temperature=2.5), 400, "temperature", None),
    ("temperature_negative", CHAT, chat(temperature=-0.1), 400, "temperature", None),
    ("top_p_zero", C, comp(top_p=0), 400, "top_p", None),
    ("top_p_above_one", CHAT, chat(top_p=1.5), 400, "top_p", None),
    ("presence_penalty_out_of_range", C, comp(presence_penalty=3), 400, "presence_penalty", None),
    ("too_many_stop_strings", C, comp(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    ("stop_wrong_type", C, comp(stop=7), 400, "stop", None),
    ("completion_logprobs_over_5", C, comp(logprobs=6), 400, "logprobs", None),
    ("unknown_field", C, comp(frobnicate=True), 400, "frobnicate", None),
    ("stream_not_bool", C, comp(stream="yes"), 400, "stream", None),
    ("stream_options_without_stream", C, comp(stream_options={"include_usage": True}), 400, "stream_options", None),
    ("empty_messages", CHAT, chat(messages=[]), 400, "messages", None),
    ("messages_missing", CHAT, {"model": MODEL}, 400, "messages", None),
    ("bad_role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role", None),
    ("image_content_part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                                            "image_url": {"url": "x"}}]}]),
     400, None, None),
    ("chat_unknown_field", CHAT, chat(functions=[]), 400, "functions", None),
    ("top_logprobs_without_logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs", None),
    ("top_logprobs_over_20", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    ("json_schema_unsupported", CHAT, chat(response_format={"type": "json_schema", "json_schema": {}}), 400,
     "response_format", None),
    ("max_completion_tokens_over_context", CHAT, chat(max_completion_tokens=4096), 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("min_tokens_past_the_context", CHAT, {"model": MODEL, "messages": OK_MSGS, "min_tokens": 5000}, 400,
     "min_tokens", "context_length_exceeded"),
    ("tool_choice_function_not_an_object", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                       tool_choice={"function": "f"}), 400, "tool_choice", None),
    ("assistant_tool_calls_not_a_list", CHAT, chat(messages=[{"role": "assistant", "content": "x", "tool_calls": 5},
                                                             *OK_MSGS]), 400, "messages.0.tool_calls", None),
    ("user_message_without_content", CHAT, chat(messages=[{"role": "user"}]), 400, "messages.0", None),
    ("required_field_null", CHAT, chat(model=None), 400, "model", None),
    ("audio_modality", CHAT, chat(modalities=["text", "audio"]), 400, "modalities.1", None),
    ("reasoning_effort_not_a_string", CHAT, chat(reasoning_effort=3), 400, "reasoning_effort", None),
    ("logit_bias_outside_vocab", C, comp(logit_bias={str(VOCAB): 10}), 400, "logit_bias", None),
    ("logit_bias_not_an_id", CHAT, chat(logit_bias={"five": 10}), 400, "logit_bias", None),
    ("logit_bias_past_100", C, comp(logit_bias={"5": 101}), 400, "logit_bias.5", None),
    ("huge_integer_top_k", C, comp(top_k=1 << 70), 400, "top_k", None),
    ("huge_seed", C, comp(seed=1 << 64), 400, "seed", None),
    ("huge_stop_token_id", CHAT, chat(stop_token_ids=[1 << 65]), 400, "stop_token_ids.0", None),
    ("nan_temperature", C, b'{"model": "glm-5.3-tiny", "prompt": "hi", "temperature": NaN}', 400, "temperature",
     None),
    ("template_kwargs_clash", CHAT, chat(chat_template_kwargs={"messages": []}), 400, "chat_template_kwargs", None),
    # a stop token id is an index into the logits: outside the vocabulary it must never reach the sampler
    ("stop_token_id_far_outside_vocab", C, comp(min_tokens=1, stop_token_ids=[1_000_000_000]), 400,
     "stop_token_ids", None),
    ("stop_token_id_equal_to_vocab_size", CHAT, chat(stop_token_ids=[5, VOCAB]), 400, "stop_token_ids", None),
    ("stop_token_id_outside_vocab_streaming", C, comp(stream=True, stop_token_ids=[VOCAB + 1]), 400,
     "stop_token_ids", None),
    ("stop_token_id_negative", C, comp(stop_token_ids=[-1]), 400, "stop_token_ids.0", None),
    # sample i of n draws with seed + i: the last one must still be a signed 64-bit seed
    ("seed_plus_n_overflows", C, comp(n=2, seed=MAX_SEED), 400, "seed", None),
    ("seed_plus_n_overflows_chat_stream", CHAT, chat(n=3, seed=MAX_SEED - 1, stream=True), 400, "seed", None),
    # malformed text inside valid JSON (issue 20.9): a lone surrogate is valid JSON but no Unicode text
    ("lone_surrogate_prompt", C, b'{"model": "glm-5.3-tiny", "prompt": "a\\ud800b"}', 400, "prompt",
     "invalid_unicode"),
    ("lone_low_surrogate_prompt_list", C, b'{"model": "glm-5.3-tiny", "prompt": ["ok", "\\udc00"]}', 400,
     "prompt.1", "invalid_unicode"),
    ("lone_surrogate_stop", C, b'{"model": "glm-5.3-tiny", "prompt": "hi", "stop": "\\ud800"}', 400, "stop",
     "invalid_unicode"),
    ("lone_surrogate_stop_stream", C, b'{"model": "glm-5.3-tiny", "prompt": "hi", "stream": true, '
     b'"stop": ["x", "\\udfff"]}', 400, "stop.1", "invalid_unicode"),
    ("lone_surrogate_chat", CHAT, b'{"model": "glm-5.3-tiny", "messages": [{"role": "user", "content": '
     b'"\\ud800"}]}', 400, "messages.0.content", "invalid_unicode"),
    ("lone_surrogate_chat_part", CHAT, b'{"model": "glm-5.3-tiny", "messages": [{"role": "user", "content": '
     b'[{"type": "text", "text": "\\udbff"}]}]}', 400, "messages.0.content.0.text", "invalid_unicode"),
    ("raw_surrogate_bytes", C, b'{"model": "glm-5.3-tiny", "prompt": "\xed\xa0\x80"}', 400, None, None),
    ("invalid_unicode_escape", C, b'{"model": "glm-5.3-tiny", "prompt": "\\uZZZZ"}', 400, None, None),
    ("deeply_nested_json", C, b"[" * 200_000, 400, None, None),
    ("deeply_nested_balanced_json", CHAT, b'{"model": "glm-5.3-tiny", "messages": ' + b"[" * DEEP + b"]" * DEEP + b"}",
     400, None, None),
]


def _send(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)


def _assert_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and len(err["message"]) <= MAX_ERROR_CHARS
    assert isinstance(err["type"], str) and err["type"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize("name,path,body,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_status_and_error_object(server, name, path, body, status, param, code):
    _assert_error(_send(server, path, body), status, param, code)


def test_the_matrix_is_large_and_the_server_still_serves_after_it(server):
    assert len(CASES) >= 20
    for _, path, body, *_ in CASES:  # all of them again, back to back
        assert 400 <= _send(server, path, body).status_code < 500
    ok = _send(server, C, comp(max_tokens=3, temperature=0))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert server.get("/health").status_code == 200
    stats = admin_stats(server)["stats"]
    assert stats["num_waiting"] == 0 and stats["num_running"] == 0  # nothing bad reached the scheduler queue


@pytest.mark.parametrize("path,body", [
    (C, comp(prompt="a\u0000b", stop="\u0000")), (CHAT, chat(messages=[{"role": "user", "content": "\u0000"}])),
    (C, comp(prompt="\U0001F600 paired surrogates are one character", user="\ud83d\ude00")),
    (CHAT, chat(messages=[{"role": "user", "content": "hi", "name": "\u0000"}])),
    # OpenAI's nullable fields sent as null mean their defaults; its fields that change no output are accepted
    (C, comp(n=None, stream=None, echo=None, logprobs=None, stop=None, seed=None, stream_options=None)),
    (CHAT, chat(n=None, stream=None, logprobs=None, temperature=None, max_tokens=None, max_completion_tokens=2)),
    (CHAT, chat(store=True, metadata={"k": "v"}, service_tier="auto", reasoning_effort="low", modalities=["text"],
                prediction={"type": "content", "content": "hi"}, prompt_cache_key="x", safety_identifier="y")),
], ids=["nul_prompt_and_stop", "nul_chat", "astral_character", "nul_name", "nulls_completion", "nulls_chat",
        "openai_fields_ignored"])
def test_odd_but_valid_text_is_accepted(server, path, body):
    r = _send(server, path, body)
    assert r.status_code == 200, r.text


def test_seed_at_the_edge_of_the_range_with_n_is_accepted(server):
    r = _send(server, C, comp(n=2, seed=MAX_SEED - 1, max_tokens=2))  # seeds MAX_SEED - 1 and MAX_SEED
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


def test_stop_token_id_inside_the_vocab_is_accepted(server):
    r = _send(server, C, comp(stop_token_ids=[VOCAB - 1], min_tokens=1, max_tokens=2))
    assert r.status_code == 200, r.text


def test_oversized_body_gets_413_before_it_is_read(server):
    big = json.dumps(comp(prompt="x" * (9 << 20))).encode()  # default --max-request-bytes is 8 MiB
    _assert_error(_send(server, C, big), 413, None, "request_too_large")

    def chunks():  # no Content-Length: the cap is enforced while reading
        yield b'{"model": "glm-5.3-tiny", "prompt": "'
        for _ in range(9):
            yield b"y" * (1 << 20)
        yield b'"}'

    r = httpx.post(server.url + C, content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    _assert_error(r, 413, None, "request_too_large")


def test_a_huge_text_prompt_is_413_before_tokenizing_and_the_server_stays_live(server):
    """Issue 20.3: a 7 MB prompt was tokenized in full (seconds of CPU) before the length check, and every
    stream and /health stalled meanwhile. It cannot fit max_req_input_len tokens, so it is refused by its
    bytes; four at once, next to a running stream and /health, are all answered promptly."""
    huge = "lorem ipsum dolor sit amet " * (7_000_000 // 27)
    bodies = [(C, comp(prompt=huge)), (C, comp(prompt=["short", huge])),
              (CHAT, chat(messages=[{"role": "user", "content": huge}])),
              (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": huge}]}]))]

    async def scenario() -> tuple[list[httpx.Response], float, list[float]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            gaps, last = [], time.monotonic()
            async with c.stream("POST", C, json=comp(max_tokens=200, stream=True, ignore_eos=True)) as stream:
                big = [asyncio.ensure_future(c.post(p, json=b)) for p, b in bodies]
                t0 = time.monotonic()
                assert (await c.get("/health")).status_code == 200
                health_s = time.monotonic() - t0
                async for _ in stream.aiter_lines():
                    gaps.append(time.monotonic() - last)
                    last = time.monotonic()
            return await asyncio.gather(*big), health_s, gaps

    responses, health_s, gaps = asyncio.run(scenario())
    for r, param in zip(responses, ("prompt", "prompt", "messages", "messages"), strict=True):
        err = _assert_error(r, 413, param, "context_length_exceeded")
        assert "max_req_input_len" in err["message"]
    assert health_s < 5.0 and max(gaps) < 5.0, (health_s, max(gaps))  # was 8.7 s for one such prompt


def test_error_messages_are_capped_for_huge_bad_values(server):
    err = _assert_error(_send(server, C, comp(model="m" * 100_000)), 404, "model")
    assert len(err["message"]) <= MAX_ERROR_CHARS
    err = _assert_error(_send(server, CHAT, chat(messages=[{"role": "r" * 50_000, "content": "hi"}])), 400)
    assert len(err["message"]) <= MAX_ERROR_CHARS


def test_unknown_route_and_wrong_method_are_error_objects(server):
    _assert_error(httpx.get(server.url + "/v1/nothing-here", timeout=10), 404)
    _assert_error(httpx.get(server.url + C, timeout=10), 405)


# ---- API key and the bounded queue: one small server ----------------------------------------------
KEY = "test-key-123"


@pytest.fixture(scope="module")
def guarded(server_factory):
    # one running request at a time and no queue: the second concurrent request is over the bound; the key
    # comes from the environment (DSASERVE_API_KEY, issue 20.8b), the flag is tested in test_server_args
    return server_factory("--max-running-requests", "1", "--max-queued-requests", "0",
                          env={"DSASERVE_API_KEY": KEY})


def test_api_key_guards_every_route_but_health_and_metrics(guarded):
    for path in ("/v1/models", "/startup", "/admin/stats"):
        r = httpx.get(guarded.url + path, timeout=10)
        _assert_error(r, 401, None, "invalid_api_key")
        r = httpx.get(guarded.url + path, headers={"Authorization": "Bearer wrong"}, timeout=10)
        _assert_error(r, 401, None, "invalid_api_key")
    r = httpx.post(guarded.url + C, json=comp(), timeout=10)
    _assert_error(r, 401)
    assert httpx.get(guarded.url + "/health", timeout=30).status_code == 200
    assert httpx.get(guarded.url + "/metrics", timeout=10).status_code == 200
    client = OpenAI(base_url=guarded.base_url, api_key=KEY, timeout=60, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_past_the_queue_bound_requests_get_429_with_retry_after(guarded):
    client = OpenAI(base_url=guarded.base_url, api_key=KEY, timeout=60, max_retries=0)
    long = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3000, stream=True,
                                     extra_body={"ignore_eos": True})
    next(iter(long))  # the first request is running
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(guarded.url + C, json=comp(), headers=headers, timeout=10)
    err = _assert_error(r, 429, None, "queue_full")
    assert r.headers["retry-after"] == "1" and "capacity" in err["message"]
    r = httpx.post(guarded.url + C, json=comp(stream=True), headers=headers, timeout=10)
    assert r.status_code == 429 and r.headers["content-type"].startswith("application/json")  # not a 200 stream
    with pytest.raises(RateLimitError):
        client.chat.completions.create(model=MODEL, messages=OK_MSGS, max_tokens=2)
    long.close()  # the client goes away: its request is aborted and the slot frees
    deadline = time.monotonic() + 20
    while True:
        r = httpx.post(guarded.url + C, json=comp(max_tokens=2), headers=headers, timeout=30)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body", [(C, comp(n=2)), (C, comp(n=2, stream=True)), (CHAT, chat(n=2, stream=True))],
                         ids=["completions", "completions_stream", "chat_stream"])
def test_n_over_max_running_requests_is_400_before_any_work(guarded, path, body):
    before = admin_stats_with_key(guarded)["stats"]["requests"]
    r = httpx.post(guarded.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    err = _assert_error(r, 400, "n")
    assert "--max-running-requests of 1" in err["message"]
    assert r.headers["content-type"].startswith("application/json")  # not a 200 stream
    assert admin_stats_with_key(guarded)["stats"]["requests"] == before  # nothing reached the scheduler


def admin_stats_with_key(s) -> dict:
    r = s.get("/admin/stats", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()
