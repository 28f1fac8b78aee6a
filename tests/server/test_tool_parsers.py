"""Tool-call parsers on recorded GLM-5 and DeepSeek-V3.2 outputs: calls and content come out right, whole and
streamed in any chunking (the deltas concatenate to the same arguments), and malformed or truncated outputs
come back as text — never an exception."""

from __future__ import annotations

import json
import random

import pytest

from dsaserve.server.tool_parsers import DeepSeekV32ToolParser, Glm5ToolParser, resolve_tool_parser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "zip": {"type": "string"}, "opts": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
D = "｜DSML｜"

GLM_RECORDED = [  # (text, content, [(name, arguments)])
    ("I'll check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
     "<arg_value>3</arg_value></tool_call>", "I'll check.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n<arg_key>zip</arg_key>\n"
     "<arg_value>01234</arg_value>\n</tool_call>", "", [("get_weather", {"city": "北京", "zip": "01234"})]),
    ("<tool_call>get_time</tool_call><tool_call>get_weather<arg_key>opts</arg_key><arg_value>{\"a\": [1, 2]}"
     "</arg_value></tool_call>", "", [("get_time", {}), ("get_weather", {"opts": {"a": [1, 2]}})]),
    ("No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
]
DS_RECORDED = [
    (f'Let me look.\n\n<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" '
     f'string="true">Paris</{D}parameter>\n<{D}parameter name="days" string="false">3</{D}parameter>\n</{D}invoke>\n'
     f'</{D}function_calls>', "Let me look.", [("get_weather", {"city": "Paris", "days": 3})]),
    (f'<{D}function_calls>\n<{D}invoke name="get_time">\n</{D}invoke>\n<{D}invoke name="get_weather">\n'
     f'<{D}parameter name="opts" string="false">{{"x": null}}</{D}parameter>\n</{D}invoke>\n</{D}function_calls>',
     "", [("get_time", {}), ("get_weather", {"opts": {"x": None}})]),
    ("Just text.", "Just text.", []),
]
CASES = [(Glm5ToolParser, *c) for c in GLM_RECORDED] + [(DeepSeekV32ToolParser, *c) for c in DS_RECORDED]


@pytest.mark.parametrize("cls,text,content,calls", CASES)
def test_recorded_outputs_parse_into_content_and_calls(cls, text, content, calls):
    out = cls(TOOLS).parse(text)
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == calls
    assert len({c.id for c in out.tool_calls}) == len(calls)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cls,text,content,calls", CASES)
def test_streamed_deltas_reassemble_to_the_whole_parse(cls, text, content, calls, seed):
    rng = random.Random(seed)
    stream = cls(TOOLS).stream()
    got_content, args, names = "", {}, {}
    pos = 0
    deltas = []
    while pos < len(text):
        step = rng.randint(1, 7)
        deltas.append(stream.feed(text[pos:pos + step]))
        pos += step
    deltas.append(stream.finish())
    for d in deltas:
        got_content += d.content
        for tc in d.tool_calls:
            if "id" in tc:
                names[tc["index"]] = tc["function"]["name"]
                assert tc["type"] == "function" and tc["function"]["arguments"] == ""
            args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
    assert got_content == content
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == calls


MALFORMED = [
    "<tool_call>", "<tool_call>get_wea", "<tool_call>get_weather<arg_key>city</arg_key><arg_val",
    "<tool_call></tool_call>", "<tool_call>get_weather<arg_key>city<arg_value>x</tool_call>", "</tool_call>",
    "<tool_call>get_weather<arg_key>days</arg_key><arg_value>not json</arg_value></tool_call>",
    f"<{D}function_calls>", f'<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" str',
    f"<{D}function_calls>\n</{D}function_calls>", f'<{D}invoke name="x">', f"</{D}function_calls>",
    f'<{D}function_calls><{D}invoke name="get_weather"><{D}parameter name="days" string="false">{{bad</{D}parameter>'
    f"</{D}invoke></{D}function_calls>", "\x00<tool_call>\ud7ff", "<" * 50, "",
]


@pytest.mark.parametrize("text", MALFORMED)
@pytest.mark.parametrize("cls", [Glm5ToolParser, DeepSeekV32ToolParser])
def test_malformed_and_truncated_outputs_return_text_and_never_raise(cls, text):
    out = cls(TOOLS).parse(text)
    for c in out.tool_calls:  # whatever is returned as a call has a name and JSON-object arguments
        assert c.name and isinstance(json.loads(c.arguments), dict)
    if not out.tool_calls:
        assert out.content == text
    stream = cls(TOOLS).stream()
    for ch in text:
        stream.feed(ch)
    stream.finish()


@pytest.mark.parametrize("cls,text,content,calls", CASES)
def test_every_truncation_of_a_recorded_output_is_safe(cls, text, content, calls):
    for cut in range(0, len(text), 3):
        out = cls(TOOLS).parse(text[:cut])
        for c in out.tool_calls:
            assert isinstance(json.loads(c.arguments), dict)
        if not out.tool_calls:
            assert out.content == text[:cut] or text[:cut].startswith(out.content)


def test_a_string_parameter_stays_text_and_others_are_json():
    p = Glm5ToolParser(TOOLS)
    out = p.parse("<tool_call>get_weather<arg_key>zip</arg_key><arg_value>007</arg_value><arg_key>days</arg_key>"
                  "<arg_value>7</arg_value><arg_key>other</arg_key><arg_value>[1]</arg_value></tool_call>")
    assert json.loads(out.tool_calls[0].arguments) == {"zip": "007", "days": 7, "other": [1]}


def test_parser_names_resolve_like_vllm_and_sglang():
    assert resolve_tool_parser("auto", "glm_moe_dsa") == "glm47"
    assert resolve_tool_parser("auto", "deepseek_v32") == "deepseek_v32"
    assert resolve_tool_parser("deepseekv32", None) == "deepseekv32"
    assert resolve_tool_parser("none", "glm_moe_dsa") is None
    with pytest.raises(ValueError, match="--tool-call-parser"):
        resolve_tool_parser("hermes", None)


@pytest.mark.parametrize("cls,call", [
    (Glm5ToolParser, "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Lima</arg_value></tool_call>"),
    (DeepSeekV32ToolParser, f'\n\n<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" '
                            f'string="true">Lima</{D}parameter>\n</{D}invoke>\n</{D}function_calls>'),
])
def test_a_call_after_thousands_of_tokens_of_text_streams_whole(cls, call):
    """The failure users report (calls breaking after ~5K tokens): a long answer with look-alike text
    (`<`, `<tool`, `｜DSML`) split at every boundary, then the call, token-sized deltas."""
    rng = random.Random(5)
    words = ["the", "<", "<tool", "call>", "｜DSML｜", "value", "\n", "<b>", "x < y", "{", "}"]
    text = " ".join(rng.choice(words) for _ in range(5000)) + call
    stream = cls(TOOLS).stream()
    content, args, names = "", "", []
    pos = 0
    while pos < len(text):
        step = rng.randint(1, 6)
        d = stream.feed(text[pos:pos + step])
        pos += step
        content += d.content
        names += [tc["function"]["name"] for tc in d.tool_calls if "id" in tc]
        args += "".join(tc["function"]["arguments"] for tc in d.tool_calls)
    d = stream.finish()
    content += d.content
    assert names == ["get_weather"] and json.loads(args) == {"city": "Lima"}
    assert content == text[: text.index(call)].rstrip()
