"""The chat formats the built-in checkpoints ship, as their real counterparts do (startup chain: written
by `make-checkpoint`, read by the server's chat encoder).

Owns: the GLM-5 Jinja chat template (GLM-4.7/5 layout: `[gMASK]<sop>`, `<|system|>` / `<|user|>` /
`<|assistant|>` / `<|observation|>` turns with no newline after the role, a `# Tools` system block listing
the functions as JSON, assistant tool calls as `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>
</tool_call>`, tool results as `<tool_response>...</tool_response>`, reasoning kept only after the last
user turn unless `clear_thinking` is false, and the generation prompt ending in `<think>` (thinking, the
default) or `</think>` (`enable_thinking=false`)), and the special / added tokens of each family's
tokenizer. DeepSeek-V3.2 ships no Jinja template: its prompts are encoded in Python
(server/chat_encoding/deepseek_v32.py), so its tokenizer_config carries none.

Also owns the template of the trained built-in `glm-5.3-mini` (dsaserve/builtin/glm-5.3-mini/
tokenizer_config.json holds this exact string; tests/server/test_builtin_chat_template.py holds the two
together). That model was trained on the layout of the GLM-4.5 era (`<|user|>\\n<question><|assistant|>\\n
<answer>`: a newline after every role marker, no `<think>`; commit 16a2c79's corpus), and its tokenizer has
none of the `<think>` / `<tool_call>` added tokens, so it cannot take GLM5_CHAT_TEMPLATE. Its template keeps
that layout byte for byte for plain chats and adds GLM-5's tool format in it: the same `# Tools` system block,
assistant calls as `<tool_call>NAME<arg_key>..</arg_key><arg_value>..</arg_value></tool_call>` right after
the content, and a run of tool results as one `<|observation|>\\n` turn of `<tool_response>..</tool_response>`.
Those tags are plain text to that tokenizer (several BPE tokens each); the GLM-5 tool parser reads text,
so it parses them all the same.
"""

from __future__ import annotations

_TOOLS_INTRO = ("<|system|>\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
                "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\\n")
_TOOLS_OUTRO = ("</tools>\\n\\nFor each function call, output the function name and arguments within the "
                "following XML format:\\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>"
                "{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>..."
                "</tool_call>")

GLM5_CHAT_TEMPLATE = (
    "{%- macro text(c) -%}{%- if c is string -%}{{ c }}{%- elif c is not none -%}{%- for p in c -%}"
    "{%- if p is mapping and p.type == 'text' -%}{{ p.text }}{%- elif p is string -%}{{ p }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{{- '[gMASK]<sop>' -}}"
    "{%- if tools -%}{{- '" + _TOOLS_INTRO + "' -}}"
    "{%- for tool in tools -%}{{- tool | tojson(ensure_ascii=False) -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '" + _TOOLS_OUTRO + "' -}}{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{- '<|system|>' + text(m.content) -}}"
    "{%- elif m.role == 'user' -%}{{- '<|user|>' + text(m.content) -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = text(m.content) -%}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}"
    "{%- if not reasoning and '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "{{- '<|assistant|>' -}}"
    "{%- if reasoning.strip() and (loop.index0 > ns.last_user or (clear_thinking is defined and not clear_thinking))"
    " -%}{{- '<think>' + reasoning.strip() + '</think>' -}}{%- else -%}{{- '</think>' -}}{%- endif -%}"
    "{{- content.strip() -}}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{{- '<tool_call>' + f.name -}}"
    "{%- for k, v in (f.arguments or {}).items() -%}{{- '<arg_key>' + k + '</arg_key><arg_value>' -}}"
    "{{- v if v is string else (v | tojson(ensure_ascii=False)) -}}{{- '</arg_value>' -}}{%- endfor -%}"
    "{{- '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}"
    "{{- '<tool_response>' + text(m.content) + '</tool_response>' -}}"
    "{%- else -%}{{- raise_exception('chat template: unknown message role ' ~ m.role) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|assistant|>' + ('</think>' if enable_thinking is defined and not enable_thinking else '<think>') -}}"
    "{%- endif -%}"
)

# The built-in glm-5.3-mini's template (see the module docstring). Every literal is a Jinja string, so the
# environment's trim_blocks / lstrip_blocks cannot touch a newline. A plain chat renders exactly as the
# template it was shipped with: `<|role|>\n` + the content as given (not stripped), `reasoning_content` and
# `enable_thinking` ignored (the model never saw `<think>`), and the generation prompt `<|assistant|>\n`.
GLM5_MINI_CHAT_TEMPLATE = (
    "{%- macro text(c) -%}{%- if c is string -%}{{ c }}{%- elif c is not none -%}{%- for p in c -%}"
    "{%- if p['type'] == 'text' -%}{{ p['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{{- '[gMASK]<sop>' -}}"
    "{%- if tools -%}{{- '" + _TOOLS_INTRO + "' -}}"
    "{%- for tool in tools -%}{{- tool | tojson(ensure_ascii=False) -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '" + _TOOLS_OUTRO + "' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}"
    # consecutive results share one observation turn, as GLM-5's do
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|observation|>\\n' -}}{%- endif -%}"
    "{{- '<tool_response>' + text(m['content']) + '</tool_response>' -}}"
    "{%- elif m['role'] in ['system', 'user', 'assistant', 'observation'] -%}"
    "{{- '<|' + m['role'] + '|>\\n' + text(m['content']) -}}"
    "{%- if m['role'] == 'assistant' -%}{%- for tc in m['tool_calls'] or [] -%}"
    "{%- set f = tc['function'] if tc['function'] is defined else tc -%}"
    "{{- '<tool_call>' + f['name'] -}}"
    "{%- for k, v in (f['arguments'] or {}).items() -%}{{- '<arg_key>' + k + '</arg_key><arg_value>' -}}"
    "{{- v if v is string else (v | tojson(ensure_ascii=False)) -}}{{- '</arg_value>' -}}{%- endfor -%}"
    "{{- '</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}"
    "{%- else -%}{{- raise_exception('chat template: unknown message role ' ~ m['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

# Added tokens that must survive skip_special_tokens (the parsers read them), as in the real tokenizers.
GLM5_ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                     "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>")
DEEPSEEK_V32_SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>",
                               "<｜Assistant｜>")
DEEPSEEK_V32_ADDED_TOKENS = ("<think>", "</think>")
