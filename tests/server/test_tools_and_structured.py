"""Tool calls, reasoning and structured output through the real server with the real `openai` client, on
the tiny random-weight models of both families: the grammar, not the weights, makes the outputs valid.

Round trips (tools -> tool_calls -> tool message -> answer, streamed and not) for GLM-5 and DeepSeek-V3.2;
50 json_schema requests that all validate; `required` always yields a parseable call; regex / choice;
hostile schemas get a 400 with the reason and the server keeps serving; reasoning split with thinking on
and off; --precompile-schemas warms the cache at startup."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.engine.test_grammar import deep_schema as _deep

GLM, DS = "glm-5.3-tiny", "deepseek-v3.2-tiny"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}}, "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
PRECOMPILED = [WEATHER, {"kind": "regex", "value": "[0-9]{3}"}]
# The GLM server runs --reasoning-parser glm45, and GLM-5 thinks by default: a grammar then starts after
# `</think>`, which random weights rarely write. Thinking off makes the grammar start at once.
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def servers(server_factory, tmp_path_factory):
    path = tmp_path_factory.mktemp("schemas") / "schemas.json"
    path.write_text(json.dumps(PRECOMPILED))
    glm = server_factory("--reasoning-parser", "glm45", "--precompile-schemas", str(path))
    ds = server_factory("--model", DS, "--reasoning-parser", "deepseek_v3")
    return {GLM: glm, DS: ds}


def _client(servers, model: str) -> OpenAI:
    return OpenAI(base_url=servers[model].base_url, api_key="unused", timeout=120, max_retries=0)


def _streamed(stream) -> dict:
    """A streamed chat choice 0 reassembled: content, reasoning, tool calls (by index), finish reason."""
    out = {"content": "", "reasoning": "", "calls": {}, "reason": None}
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta
            out["content"] += d.content or ""
            out["reasoning"] += getattr(d, "reasoning_content", None) or ""
            indices = [tc.index for tc in d.tool_calls or []]
            assert len(indices) == len(set(indices)), "one entry per call index in a chunk (OpenAI's)"
            for tc in d.tool_calls or []:
                call = out["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert call["id"] is None, "a call's id comes once, in its first delta"
                    call["id"], call["name"] = tc.id, tc.function.name
                call["arguments"] += tc.function.arguments or ""
            out["reason"] = c.finish_reason or out["reason"]
    return out


def _calls(message_or_stream, streamed: bool) -> tuple[list[tuple[str, dict]], list[dict]]:
    """((name, arguments), ...) and the assistant tool_calls to send back."""
    if streamed:
        raw = [message_or_stream["calls"][i] for i in sorted(message_or_stream["calls"])]
    else:
        raw = [{"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
               for tc in message_or_stream.tool_calls or []]
    back = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in raw]
    return [(c["name"], json.loads(c["arguments"])) for c in raw], back


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("model", [GLM, DS])
def test_tool_round_trip(servers, model, stream):
    client = _client(servers, model)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=model, messages=USER, tools=TOOLS, tool_choice=named,
                                       max_tokens=64, temperature=1.0, seed=7, stream=stream, extra_body=NO_THINK)
    got = _streamed(r) if stream else r.choices[0]
    reason = got["reason"] if stream else got.finish_reason
    calls, back = _calls(got if stream else got.message, stream)
    assert reason == "stop" and [n for n, _ in calls] == ["get_weather"]  # a forced call stops, as OpenAI's
    jsonschema.validate(calls[0][1], WEATHER)
    assert back[0]["id"].startswith("call_")
    history = USER + [{"role": "assistant", "content": None, "tool_calls": back},
                      {"role": "tool", "tool_call_id": back[0]["id"], "content": "sunny, 21 C"}]
    r2 = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=8, temperature=0,
                                        stream=stream, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    answer = _streamed(r2) if stream else r2.choices[0].message
    text = answer["content"] if stream else answer.content
    assert text or (answer["calls"] if stream else answer.tool_calls)


def _random_schema(rng: random.Random) -> dict:
    leaves = [{"type": "integer", "minimum": -50, "maximum": 999}, {"type": "boolean"}, {"type": "null"},
              {"type": "string", "maxLength": rng.randint(0, 6)}, {"enum": ["red", "green", 3, None]},
              {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
              {"type": "string", "pattern": "[a-f]{2,4}"}]
    props = {f"k{i}": rng.choice(leaves) for i in range(rng.randint(1, 4))}
    if rng.random() < 0.4:
        props["inner"] = {"type": "object", "properties": {"x": rng.choice(leaves)}, "required": ["x"]}
    required = sorted(rng.sample(list(props), rng.randint(0, len(props))))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def test_json_schema_outputs_validate_for_50_varied_schemas(servers):
    client = _client(servers, GLM)
    rng = random.Random(19)
    schemas = [_random_schema(rng) for _ in range(50)]

    def ask(i: int) -> tuple[dict, str, str]:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i], "strict": True}}
        r = client.chat.completions.create(model=GLM, messages=USER, response_format=fmt, max_tokens=160,
                                           temperature=1.0, seed=i, extra_body=NO_THINK)
        return schemas[i], r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(50)))
    for schema, content, reason in results:
        assert reason == "stop", (schema, content)
        jsonschema.validate(json.loads(content), schema)


@pytest.mark.parametrize("model", [GLM, DS])
def test_required_tool_choice_always_yields_a_parseable_call(servers, model):
    client = _client(servers, model)
    for seed in range(6):
        parallel = seed % 2 == 0
        stream = seed % 3 == 0
        r = client.chat.completions.create(model=model, messages=USER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=parallel, max_tokens=120, temperature=1.0,
                                           seed=seed, stream=stream, extra_body=NO_THINK)
        calls, _ = _calls(_streamed(r) if stream else r.choices[0].message, stream)
        assert calls and (parallel or len(calls) == 1)
        for name, args in calls:
            jsonschema.validate(args, SCHEMAS[name])


def test_regex_choice_and_the_completions_endpoint(servers):
    client = _client(servers, GLM)
    choice = {"structured_outputs": {"choice": ["yes", "no", "maybe"]}, **NO_THINK}
    r = client.chat.completions.create(model=GLM, messages=USER, max_tokens=20, temperature=1.0, seed=1,
                                       extra_body=choice)
    assert r.choices[0].message.content in ("yes", "no", "maybe")
    r = client.chat.completions.create(model=GLM, messages=USER, max_tokens=20, temperature=1.0, seed=2,
                                       extra_body={"regex": "[0-9]{3}-[a-z]{2}", **NO_THINK})  # SGLang's name
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].message.content)
    c = client.completions.create(model=GLM, prompt="JSON:", max_tokens=60, temperature=1.0, seed=3,
                                  extra_body={"structured_outputs": {"json": WEATHER}})
    jsonschema.validate(json.loads(c.choices[0].text), WEATHER)


@pytest.mark.parametrize("body,param,reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": _deep(200)}}},
     "response_format", "nested deeper"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": list(range(5000))}}}},
     "response_format", "enum/const values"),
    ({"structured_outputs": {"regex": "(a|aa)*(b|bb){1,100000}"}}, "structured_outputs", "exceeds the limit"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "invalid regular expression"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "nonsense"}}}},
     "response_format", "nonsense"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools", "nonsense"),
])
def test_hostile_and_invalid_schemas_get_400_with_the_reason(servers, body, param, reason):
    url = servers[GLM].base_url + "/chat/completions"
    for stream in (False, True):
        r = httpx.post(url, json={"model": GLM, "messages": USER, "max_tokens": 4, "stream": stream, **body},
                       timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and reason in err["message"]
    ok = _client(servers, GLM).chat.completions.create(model=GLM, messages=USER, max_tokens=2, timeout=20)
    assert ok.choices[0].finish_reason == "length"  # the scheduler was never stalled


@pytest.mark.parametrize("model,on", [(GLM, {}), (DS, {"thinking": True})])
def test_reasoning_split_with_thinking_on_and_off(servers, model, on):
    client = _client(servers, model)
    kw = {"model": model, "messages": USER, "max_tokens": 12, "temperature": 0}
    thinking = client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": on}).choices[0].message
    assert thinking.reasoning_content  # random weights: all of it (or up to a random </think>) is reasoning
    streamed = _streamed(client.chat.completions.create(**kw, stream=True,
                                                        extra_body={"chat_template_kwargs": on}))
    assert streamed["reasoning"] == thinking.reasoning_content
    assert streamed["content"] == (thinking.content or "")
    off = client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert getattr(off.choices[0].message, "reasoning_content", None) is None and off.choices[0].message.content


def test_with_thinking_on_the_schema_applies_after_the_reasoning(servers):
    client = _client(servers, GLM)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    for seed in range(3):
        r = client.chat.completions.create(model=GLM, messages=USER, response_format=fmt, max_tokens=300,
                                           temperature=1.0, seed=seed)
        msg = r.choices[0].message
        assert msg.reasoning_content is not None  # free text until </think> (random weights: maybe never)
        if msg.content is not None:
            jsonschema.validate(json.loads(msg.content), WEATHER)


def test_precompiled_schemas_are_warm_at_startup(servers):
    info = servers[GLM].get("/startup").json()["scheduler_info"]
    assert info["warmed_schemas"] == len(PRECOMPILED) and "grammar_warmup" in info["startup_time"]
    client = _client(servers, GLM)
    client.chat.completions.create(model=GLM, messages=USER, max_tokens=40, extra_body={
        "structured_outputs": {"json": WEATHER}, **NO_THINK})
    metrics = servers[GLM].get("/metrics").text
    hits = re.search(r"^dsaserve_grammar_cache_hits_total ([0-9.]+)", metrics, re.M)
    assert hits and float(hits.group(1)) >= 1  # the warmed schema was a cache hit
