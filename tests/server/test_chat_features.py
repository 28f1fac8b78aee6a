"""The chat plan (tools / tool_choice / response_format / structured_outputs -> what is rendered and enforced,
400s naming the field) and the per-choice readback (forced calls whole and streamed, parallel_tool_calls)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dsaserve.server.chat_features import ChatPlanError, ChoiceOutput, plan_chat
from dsaserve.server.protocol import ResponseFormat

TOOLS = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}, {"type": "function", "function": {"name": "b"}}]


def req(**kw):
    base = {"tools": None, "tool_choice": None, "parallel_tool_calls": None, "response_format": None,
            "chat_template_kwargs": None, "structured_outputs": None}
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kw,param,msg", [
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "not one of"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "zzz"}}}, "tool_choice", "zzz"),
    ({"tools": [{"type": "retrieval"}]}, "tools", r"tools\[0\]"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": ResponseFormat(type="json_object")},
     "tool_choice", "cannot be combined"),
    ({"response_format": ResponseFormat(type="json_object"), "structured_outputs": {"regex": "a"}},
     "structured_outputs", "only one of"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"response_format": ResponseFormat(type="json_schema", json_schema={"name": "x"})}, "response_format",
     "needs a `schema`"),
])
def test_bad_plans_name_the_field(kw, param, msg):
    with pytest.raises(ChatPlanError, match=msg) as e:
        plan_chat(req(**kw), "glm47")
    assert e.value.param == param


def test_auto_needs_a_parser_and_none_needs_nothing():
    with pytest.raises(ChatPlanError, match="--tool-call-parser none"):
        plan_chat(req(tools=TOOLS), None)
    assert plan_chat(req(tools=TOOLS, tool_choice="none"), None).tool_mode == "none"


def test_forced_choices_get_a_grammar_and_thinking_off():
    named = plan_chat(req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "a"}}), "glm47")
    assert named.grammar["kind"] == "json_schema" and json.loads(named.grammar["value"])["properties"]["x"]
    assert named.template_kwargs["enable_thinking"] is False and named.template_kwargs["thinking"] is False
    required = plan_chat(req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), "glm47")
    schema = json.loads(required.grammar["value"])
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2


def test_with_a_reasoning_parser_a_grammar_leaves_thinking_to_the_request():
    plan = plan_chat(req(tools=TOOLS, tool_choice="required"), "glm47", reason_first=True)
    assert plan.grammar is not None and "enable_thinking" not in plan.template_kwargs


def test_forced_outputs_read_back_whole_and_streamed():
    named = plan_chat(req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "a"}}), "glm47")
    out = ChoiceOutput(named, "glm47", False, False)
    msg = out.whole('{"x": 5}')
    assert msg["content"] is None and msg["tool_calls"][0]["function"] == {"name": "a", "arguments": '{"x": 5}'}
    assert out.finish_reason("stop") == "stop" and out.finish_reason("length") == "length"  # forced: OpenAI's
    s = ChoiceOutput(named, "glm47", False, False)
    deltas = [s.feed('{"x"'), s.feed(": 5}", final=True)]
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "a"
    assert "".join(d["function"]["arguments"] for x in deltas for d in x["tool_calls"]) == '{"x": 5}'
    # one entry per call index in a chunk, as OpenAI streams them: the header and its first arguments together
    assert deltas[0]["tool_calls"] == [{"index": 0, "id": deltas[0]["tool_calls"][0]["id"], "type": "function",
                                        "function": {"name": "a", "arguments": '{"x"'}}]
    required = plan_chat(req(tools=TOOLS, tool_choice="required"), "glm47")
    r = ChoiceOutput(required, "glm47", False, False)
    assert r.feed('[{"name": "b", "parameters": {}}') == {}
    end = r.feed(', {"name": "a", "parameters": {"x": 1}}]', final=True)["tool_calls"]
    assert [d["index"] for d in end] == [0, 1]
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in end] == [("b", "{}"), ("a", '{"x": 1}')]
    assert r.finish_reason("stop") == "tool_calls"
    cut = ChoiceOutput(required, "glm47", False, False).whole('[{"name": "a", "par')  # max_tokens hit
    assert "tool_calls" not in cut
    cut = ChoiceOutput(required, "glm47", False, False)  # the calls complete before the cut are returned
    assert cut.whole('[{"name": "b", "parameters": {}},\n {"name": "a", "parameters": {"x"')["tool_calls"][0][
        "function"] == {"name": "b", "arguments": "{}"} and cut.num_calls == 1
    assert cut.finish_reason("length") == "length"


def test_auto_with_parallel_off_keeps_the_first_call_and_reasoning_comes_first():
    text = ("hmm</think>ok<tool_call>a<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>"
            "<tool_call>b</tool_call>")
    plan = plan_chat(req(tools=TOOLS, parallel_tool_calls=False), "glm47")
    msg = ChoiceOutput(plan, "glm47", True, True).whole(text)
    assert msg["reasoning_content"] == "hmm" and msg["content"] == "ok"
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["a"]
    s = ChoiceOutput(plan, "glm47", True, True)
    got = [s.feed(text[i:i + 4], final=i + 4 >= len(text)) for i in range(0, len(text), 4)]
    names = [d["function"]["name"] for g in got for d in g.get("tool_calls", []) if "id" in d]
    assert names == ["a"] and "".join(g.get("reasoning_content", "") for g in got) == "hmm"


def test_a_named_call_after_reasoning_starts_when_the_reasoning_ends():
    named = plan_chat(req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "a"}}), "glm47",
                      reason_first=True)
    s = ChoiceOutput(named, "glm47", True, True)
    first = s.feed("thinking about x")
    assert first == {"reasoning_content": "thinking about x"}  # no call header while reasoning
    rest = s.feed('</think>{"x": 2}', final=True)
    assert rest["tool_calls"][0]["function"]["name"] == "a" and s.finish_reason("stop") == "stop"
    cut = ChoiceOutput(named, "glm47", True, True).whole("never finished thinking")
    assert cut["reasoning_content"] == "never finished thinking" and "tool_calls" not in cut
