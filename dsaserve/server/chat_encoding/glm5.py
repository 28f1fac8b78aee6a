"""GLM-5 (and any checkpoint with a Jinja chat template): render the checkpoint's own template (stage 1).

Owns: what GLM-5's template is given — `tools` only when the request has some (so a plain chat renders
exactly as transformers renders it), `chat_template_kwargs` as template variables (`enable_thinking`,
`clear_thinking`), assistant tool-call arguments as objects (the template writes them as
`<arg_key>`/`<arg_value>` pairs) — and reading back whether the prompt opened `<think>`.
"""

from __future__ import annotations

from typing import Any

from dsaserve.server.chat_encoding.base import THINK_START, EncodedPrompt, parsed_tool_calls
from dsaserve.server.hf_tokenizer import HFTokenizer


class TemplateEncoder:
    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tok = tokenizer

    def encode(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               kwargs: dict[str, Any] | None = None) -> EncodedPrompt:
        extra = dict(kwargs or {})
        if tools:
            extra["tools"] = tools
        text = self.tok.apply_chat_template(parsed_tool_calls(messages), add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, **extra)
        return EncodedPrompt(text, add_generation_prompt and text.endswith(THINK_START))
