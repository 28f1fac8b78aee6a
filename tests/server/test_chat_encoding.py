"""Chat encoding of both families: GLM-5's template (tools, thinking on/off, tool calls and results) and
DeepSeek-V3.2's published encoding (its reference examples reproduced exactly), and a full tool round trip
through encoder -> parser for each."""

from __future__ import annotations

import json

import pytest

from dsaserve.config import load_config
from dsaserve.server.chat_encoding import encoder_for
from dsaserve.server.chat_encoding.deepseek_v32 import DeepSeekV32Encoder
from dsaserve.server.chat_encoding.glm5 import TemplateEncoder
from dsaserve.server.hf_tokenizer import ChatTemplateError, HFTokenizer
from dsaserve.server.tool_parsers import DeepSeekV32ToolParser, Glm5ToolParser
from dsaserve.weights.tokenizer_builder import write_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                        "arguments": '{"city": "Paris", "days": 2}'}}
ROUND_TRIP = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    d = tmp_path_factory.mktemp("glm")
    write_tokenizer(load_config("glm-5.3-tiny"), d)
    return TemplateEncoder(HFTokenizer(d))


def test_glm5_renders_tools_calls_and_results(glm):
    enc = glm.encode(ROUND_TRIP, tools=TOOLS)
    assert enc.text.startswith("[gMASK]<sop><|system|>\n# Tools\n")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in enc.text
    assert ("<|user|>Weather in Paris?<|assistant|></think><tool_call>get_weather<arg_key>city</arg_key>"
            "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
            "<|observation|><tool_response>sunny, 21 C</tool_response><|assistant|><think>") in enc.text
    assert enc.thinking


def test_glm5_thinking_switch_and_reasoning_history(glm):
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r1"},
            {"role": "user", "content": "c"}]
    on = glm.encode(msgs)
    off = glm.encode(msgs, kwargs={"enable_thinking": False})
    assert on.text.endswith("<|user|>c<|assistant|><think>") and on.thinking
    assert off.text.endswith("<|user|>c<|assistant|></think>") and not off.thinking
    assert "r1" not in on.text  # reasoning before the last user turn is dropped (clear_thinking)
    kept = glm.encode(msgs, kwargs={"clear_thinking": False})
    assert "<|assistant|><think>r1</think>b" in kept.text


def test_glm5_rendered_call_parses_back(glm):
    text = glm.encode(ROUND_TRIP[:2], tools=TOOLS, add_generation_prompt=False).text
    rendered = text[text.rindex("<tool_call>"):]  # the assistant's call (the system prompt shows the format)
    out = Glm5ToolParser(TOOLS).parse(rendered)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris",
                                                                                            "days": 2})]


def test_bad_tool_call_arguments_are_template_errors(glm):
    bad = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{nope"}}]}]
    with pytest.raises(ChatTemplateError, match="not valid JSON"):
        glm.encode(bad)


# DeepSeek-V3.2: the reference's own example (encoding/encoding_dsv32.py of the checkpoint)
def test_deepseek_v32_reproduces_the_published_example():
    msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "thinking..."},
            {"role": "user", "content": "1+1=?"}]
    enc = DeepSeekV32Encoder().encode(msgs, kwargs={"thinking": True})
    assert enc.text == ("<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>hello<｜Assistant｜></think>"
                        "Hello! I am DeepSeek.<｜end▁of▁sentence｜><｜User｜>1+1=?<｜Assistant｜><think>")
    assert enc.thinking
    chat = DeepSeekV32Encoder().encode(msgs)
    assert chat.text.endswith("<｜User｜>1+1=?<｜Assistant｜></think>") and not chat.thinking


def test_deepseek_v32_tools_calls_and_results():
    enc = DeepSeekV32Encoder().encode(ROUND_TRIP, tools=TOOLS, kwargs={"thinking": True})
    assert enc.text.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n")
    schema = json.dumps(TOOLS[0]["function"], ensure_ascii=False)
    assert f"<functions>\n{schema}\n</functions>" in enc.text
    call = ('<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>')
    assert f"<｜Assistant｜><think></think>\n\n<｜DSML｜function_calls>\n{call}\n</｜DSML｜function_calls>" \
           "<｜end▁of▁sentence｜>" in enc.text
    assert enc.text.endswith("\n\n<function_results>\n<result>sunny, 21 C</result>\n</function_results>\n\n<think>")
    block = enc.text[enc.text.rindex("\n\n<｜DSML｜function_calls>"):enc.text.index("<｜end▁of▁sentence｜>")]
    out = DeepSeekV32ToolParser(TOOLS).parse("Checking." + block)
    assert out.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris",
                                                                                            "days": 2})]


def test_deepseek_v32_tool_result_without_a_call_is_a_clean_error():
    with pytest.raises(ChatTemplateError, match="tool result"):
        DeepSeekV32Encoder().encode([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])


def test_the_encoder_follows_the_checkpoint_family(tmp_path, glm):
    write_tokenizer(load_config("deepseek-v3.2-tiny"), tmp_path)
    assert isinstance(encoder_for("deepseek_v32", HFTokenizer(tmp_path)), DeepSeekV32Encoder)
    assert isinstance(encoder_for("glm_moe_dsa", glm.tok), TemplateEncoder)
