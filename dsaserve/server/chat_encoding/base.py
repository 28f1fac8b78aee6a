"""What every chat encoder shares (request path stage 1).

Owns: `EncodedPrompt` (the prompt text and whether it leaves the model inside an open `<think>`), the
`ChatEncoder` protocol, and the clean-up of assistant tool calls (arguments given as JSON text become
objects, as vLLM does before rendering; a call without a name or with non-object arguments is a
ChatTemplateError).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Protocol

from dsaserve.server.hf_tokenizer import ChatTemplateError

THINK_START, THINK_END = "<think>", "</think>"  # both families' reasoning block


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
            if not isinstance(m["tool_calls"], list):
                raise ChatTemplateError(f"messages[{i}].tool_calls: must be a list of calls")
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
