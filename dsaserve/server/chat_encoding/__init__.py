"""Chat encoding: OpenAI messages (+ tools, + thinking switch) -> the prompt text of a model family (stage 1).

Owns: the encoder registry keyed by config.json's `model_type` (`glm_moe_dsa`: the checkpoint's own Jinja
template, GLM-5's; `deepseek_v32`: DeepSeek-V3.2's published Python encoding, since that checkpoint ships no
Jinja template), the common input clean-up (tool-call arguments given as JSON text become objects, as vLLM
does before rendering), and `EncodedPrompt.thinking`: whether the prompt leaves the model inside an open
`<think>`, which is what the reasoning parser needs to know.

Errors are `ChatTemplateError` (a ValueError): the serving layer turns them into 400s on `messages`.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Protocol

from dsaserve.server.hf_tokenizer import ChatTemplateError, HFTokenizer

THINK_START = "<think>"


@dataclass(frozen=True)
class EncodedPrompt:
    text: str
    thinking: bool  # the prompt ends inside an open <think>: the output starts with reasoning


class ChatEncoder(Protocol):
    def encode(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               kwargs: dict[str, Any] | None = None) -> EncodedPrompt: ...


def parsed_tool_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy of messages where each assistant tool call's `arguments` is an object (JSON text parsed)."""
    out = []
    for i, m in enumerate(messages):
        if m.get("role") == "assistant" and m.get("tool_calls"):
            m = copy.deepcopy(m)
            for tc in m["tool_calls"]:
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ChatTemplateError(f"messages[{i}].tool_calls: each call needs function.name")
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise ChatTemplateError(f"messages[{i}].tool_calls: arguments of {fn['name']!r} are "
                                                "not valid JSON") from None
                if not isinstance(args, dict):
                    raise ChatTemplateError(f"messages[{i}].tool_calls: arguments of {fn['name']!r} must be "
                                            "a JSON object")
                fn["arguments"] = args
        out.append(m)
    return out


def encoder_for(model_type: str | None, tokenizer: HFTokenizer) -> ChatEncoder:
    """The family's encoder; any other model type renders its checkpoint's Jinja template."""
    from dsaserve.server.chat_encoding.deepseek_v32 import DeepSeekV32Encoder
    from dsaserve.server.chat_encoding.glm5 import TemplateEncoder

    if model_type == "deepseek_v32" and not tokenizer.chat_template:
        return DeepSeekV32Encoder()
    return TemplateEncoder(tokenizer)


__all__ = ["ChatEncoder", "ChatTemplateError", "EncodedPrompt", "encoder_for", "parsed_tool_calls"]
