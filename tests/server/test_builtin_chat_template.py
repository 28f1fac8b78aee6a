"""The trained built-in model's (glm-5.3-mini) chat template through the server's own path (HFTokenizer ->
ChatSettings -> its encoder): a plain chat renders byte for byte as the template it shipped with (the layout
the model was trained on), and tools, assistant tool calls and tool results render in GLM-5's tool format
inside that layout; the real `openai` client sends tools to a server of that model."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from dsaserve.server.chat_encoding import parsed_tool_calls
from dsaserve.server.chat_encoding.glm5 import TemplateEncoder
from dsaserve.server.chat_features import ChatSettings
from dsaserve.server.hf_tokenizer import HFTokenizer
from dsaserve.server.tool_parsers import TOOL_PARSERS, Glm5ToolParser
from dsaserve.weights.chat_templates import GLM5_MINI_CHAT_TEMPLATE
from dsaserve.weights.checkpoint_cache import packaged_checkpoint

MINI = "glm-5.3-mini"
CKPT = packaged_checkpoint(MINI)
pytestmark = pytest.mark.skipif(CKPT is None, reason="dsaserve/builtin/glm-5.3-mini is not in this checkout")

# The template glm-5.3-mini shipped with (commit 34d86fd), kept verbatim: plain chats must still render as it did.
SHIPPED_TEMPLATE = (
    "[gMASK]<sop>{%- for message in messages -%}{%- set role = 'observation' if message['role'] == 'tool' else "
    "message['role'] -%}{%- if role not in ['system', 'user', 'assistant', 'observation'] -%}{{- raise_exception("
    "'chat template: unknown message role ' ~ message['role']) -}}{%- endif -%}<|{{ role }}|>\n{% if message["
    "'content'] is string %}{{ message['content'] }}{%- elif message['content'] is not none -%}{%- for part in "
    "message['content'] -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>\n{% endif %}"
)
PLAIN = [
    [{"role": "user", "content": "What does `json.dumps` do?"}],
    [{"role": "system", "content": " Be brief.\n"}, {"role": "user", "content": "naïve  café — 北京 🤖\n"},
     {"role": "assistant", "content": " Hi. ", "reasoning_content": "dropped"}, {"role": "user", "content": "Again?"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "<think>a</think>b", "tool_calls": []}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": None}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time, «ISO»",
                                           "parameters": {"type": "object", "properties": {
                                               "tz": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
           {"role": "tool", "tool_call_id": "call_1", "content": "rain tomorrow"}]
CALL_TEXT = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
             "<arg_value>2</arg_value></tool_call>")


@pytest.fixture(scope="module")
def mini_tok() -> HFTokenizer:
    return HFTokenizer(CKPT)


@pytest.fixture(scope="module")
def mini(mini_tok) -> ChatSettings:
    """The server's chat settings for the built-in model, as TokenizerManager builds them."""
    return ChatSettings.build(str(CKPT), mini_tok)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory) -> TemplateEncoder:
    """An encoder of the same tokenizer with the template the model shipped with."""
    d = tmp_path_factory.mktemp("shipped")
    (d / "tokenizer.json").write_bytes((CKPT / "tokenizer.json").read_bytes())
    cfg = json.loads((CKPT / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": SHIPPED_TEMPLATE}))
    return TemplateEncoder(HFTokenizer(d))


def test_the_shipped_template_is_the_one_defined_in_code(mini_tok):
    assert mini_tok.chat_template == GLM5_MINI_CHAT_TEMPLATE


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("conv", range(len(PLAIN)))
def test_a_plain_chat_renders_as_the_shipped_template_did(mini, shipped, conv, gen):
    for kwargs in (None, {"enable_thinking": False}):
        ours = mini.encoder.encode(PLAIN[conv], add_generation_prompt=gen, kwargs=kwargs)
        assert ours == shipped.encode(PLAIN[conv], add_generation_prompt=gen, kwargs=kwargs)
        assert not ours.thinking


def test_a_plain_chat_is_the_trained_layout(mini):
    """The trainer's chat sample (train_report.json) is this exact rendering: a newline after each role."""
    text = mini.encoder.encode(PLAIN[0]).text
    assert text == "[gMASK]<sop><|user|>\nWhat does `json.dumps` do?<|assistant|>\n"
    assert text in json.loads((CKPT / "train_report.json").read_text())["samples"]


def test_tools_render_as_a_system_block_in_the_mini_layout(mini):
    enc = mini.encoder.encode(PLAIN[0], tools=TOOLS)
    for tool in TOOLS:
        assert json.dumps(tool, ensure_ascii=False) + "\n" in enc.text
    assert enc.text.startswith("[gMASK]<sop><|system|>\n# Tools\n\n")
    assert "format:\n<tool_call>{function-name}<arg_key>" in enc.text
    assert enc.text.endswith("</tool_call><|user|>\nWhat does `json.dumps` do?<|assistant|>\n")
    assert not enc.thinking


def test_a_tool_call_and_two_results_render_as_one_call_and_one_observation(mini):
    enc = mini.encoder.encode(HISTORY, tools=TOOLS)
    assert enc.text.endswith(f"<|user|>\nWeather in Paris?<|assistant|>\n{CALL_TEXT}<|observation|>\n"
                             "<tool_response>sunny, 21 C</tool_response><tool_response>rain tomorrow</tool_response>"
                             "<|assistant|>\n")
    assert enc.text.count("<|observation|>") == 1
    with_content = [HISTORY[0], {**HISTORY[1], "content": "Let me look."}]
    text = mini.encoder.encode(with_content, add_generation_prompt=False).text
    assert text.endswith(f"<|assistant|>\nLet me look.{CALL_TEXT}")


def test_transformers_renders_the_same(mini):
    hf = AutoTokenizer.from_pretrained(str(CKPT))
    for msgs, tools in ((HISTORY, TOOLS), (PLAIN[1], None)):
        ours = mini.encoder.encode(msgs, tools=tools).text
        kw = {"tools": tools} if tools else {}
        assert ours == hf.apply_chat_template(parsed_tool_calls(msgs), add_generation_prompt=True, tokenize=False,
                                              **kw)


def test_a_call_in_the_mini_tokens_parses_back(mini, mini_tok):
    """The mini's tokenizer has no `<tool_call>` tokens (it was trained without them): the tags are plain BPE
    text, which survives the detokenizer's skip_special_tokens, and the GLM-5 parser reads them from text."""
    assert len(mini_tok.encode("<tool_call>", add_special_tokens=False)) > 1
    text = mini_tok.decode(mini_tok.encode(CALL_TEXT, add_special_tokens=False), skip_special_tokens=True)
    assert TOOL_PARSERS[mini.tool_parser] is Glm5ToolParser  # the parser the server picks for this model
    out = Glm5ToolParser(TOOLS).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris",
                                                                                            "days": 2})]


def test_openai_client_sends_tools_to_the_builtin_server(server_factory, mini, mini_tok):
    server = server_factory("--model", MINI)
    client = OpenAI(base_url=server.base_url, api_key="unused", timeout=60, max_retries=0)

    def n_tokens(text: str) -> int:
        return len(mini_tok.encode(text, add_special_tokens=False))

    tools_json = sum(n_tokens(json.dumps(t, ensure_ascii=False)) for t in TOOLS)
    for msgs in (PLAIN[0], HISTORY):
        r = client.chat.completions.create(model=MINI, messages=msgs, tools=TOOLS, max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
        assert r.usage.prompt_tokens == n_tokens(mini.encoder.encode(msgs, tools=TOOLS).text)
        # the tools reached the prompt: it is longer than the same chat's without them by their JSON at least
        assert r.usage.prompt_tokens - n_tokens(mini.encoder.encode(msgs).text) > tools_json
