"""DeepSeek-V3.2's chat encoding, written from its published format (`encoding/encoding_dsv32.py` of the
checkpoint), since the checkpoint ships no Jinja template (request path stage 1).

Owns: the prompt of a conversation —

    <｜begin▁of▁sentence｜>{system}[\\n\\n## Tools ... <functions>{tool JSON per line}</functions>]
    <｜User｜>{user}<｜Assistant｜>  then  <think> (thinking mode, last user turn) or </think>
    {reasoning}</think>{content}[\\n\\n<｜DSML｜function_calls>...</｜DSML｜function_calls>]<｜end▁of▁sentence｜>
    \\n\\n<function_results>\\n<result>{tool output}</result>...\\n</function_results>\\n\\n<think> or </think>

— thinking mode from `chat_template_kwargs` `thinking` (SGLang's, vLLM's name for this model) or
`enable_thinking` (default off, as in the reference), reasoning of turns before the last user message
dropped (the reference's `drop_thinking`), tools attached to the system message (one is made if there
is none). Messages the format cannot express (a tool result without a preceding call) are
ChatTemplateErrors, not assertions.
"""

from __future__ import annotations

import json
from typing import Any

from dsaserve.server.chat_encoding.base import THINK_END, THINK_START, EncodedPrompt, parsed_tool_calls
from dsaserve.server.hf_tokenizer import ChatTemplateError

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
DSML = "｜DSML｜"

TOOLS_SYSTEM = """## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{d}function_calls>" block like the following as part of your reply to the user:
<{d}function_calls>
<{d}invoke name="$FUNCTION_NAME">
<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>
...
</{d}invoke>
<{d}invoke name="$FUNCTION_NAME2">
...
</{d}invoke>
</{d}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects \
should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" \
for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking \
block. Here is an example:

<{d}function_calls>
...
</{d}function_calls>

<function_results>
...
</function_results>

{ts}...thinking about results{te}

Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""


def to_json(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False)


def render_tools(tools: list[dict[str, Any]]) -> str:
    schemas = "\n".join(to_json(t.get("function", t)) for t in tools)
    return TOOLS_SYSTEM.format(d=DSML, ts=THINK_START, te=THINK_END, schemas=schemas)


def render_tool_calls(calls: list[dict[str, Any]]) -> str:
    invokes = []
    for tc in calls:
        fn = tc.get("function", tc)
        params = [f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                  f'{v if isinstance(v, str) else to_json(v)}</{DSML}parameter>' for k, v in fn["arguments"].items()]
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return f"\n\n<{DSML}function_calls>\n" + "\n".join(invokes) + f"\n</{DSML}function_calls>"


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


class DeepSeekV32Encoder:
    def encode(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               kwargs: dict[str, Any] | None = None) -> EncodedPrompt:
        kw = kwargs or {}
        thinking = bool(kw.get("thinking", kw.get("enable_thinking", False)))
        msgs = parsed_tool_calls(messages)
        if tools:
            if msgs and msgs[0].get("role") == "system":
                msgs[0] = {**msgs[0], "tools": tools}
            else:
                msgs.insert(0, {"role": "system", "content": "", "tools": tools})
        last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=-1)
        parts = [BOS] + [self._message(i, msgs, thinking, last_user) for i in range(len(msgs))]
        text = "".join(parts)
        if continue_final_message and msgs and msgs[-1].get("role") == "assistant" and text.endswith(EOS):
            text = text[: -len(EOS)]
        return EncodedPrompt(text, thinking and text.endswith(THINK_START))

    def _message(self, i: int, msgs: list[dict[str, Any]], thinking: bool, last_user: int) -> str:
        m = msgs[i]
        role, content = m.get("role"), _text(m.get("content"))
        if role == "system":
            return content + ("\n\n" + render_tools(m["tools"]) if m.get("tools") else "")
        if role == "user":
            return f"{USER}{content}{ASSISTANT}" + (THINK_START if thinking and i == last_user else THINK_END)
        if role == "assistant":
            reasoning = ""
            if thinking and i > last_user:
                reasoning = _text(m.get("reasoning_content")) + THINK_END
            calls = render_tool_calls(m["tool_calls"]) if m.get("tool_calls") else ""
            return f"{reasoning}{content}{calls}{EOS}"
        if role == "tool":
            return self._tool_result(i, msgs, content, thinking, last_user)
        raise ChatTemplateError(f"messages[{i}].role: {role!r} is not a DeepSeek-V3.2 role")

    @staticmethod
    def _tool_result(i: int, msgs: list[dict[str, Any]], content: str, thinking: bool, last_user: int) -> str:
        a = i - 1
        while a >= 0 and msgs[a].get("role") == "tool":
            a -= 1
        calls = msgs[a].get("tool_calls") if a >= 0 and msgs[a].get("role") == "assistant" else None
        order = i - a
        if not calls or order > len(calls):
            raise ChatTemplateError(f"messages[{i}]: a tool result must follow an assistant message with as many "
                                    "tool_calls")
        out = ("\n\n<function_results>" if order == 1 else "") + f"\n<result>{content}</result>"
        if order == len(calls) or i + 1 == len(msgs) or msgs[i + 1].get("role") != "tool":
            out += "\n</function_results>\n\n" + (THINK_START if thinking and i >= last_user else THINK_END)
        return out
