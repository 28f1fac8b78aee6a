"""Chat encoding: OpenAI messages (+ tools, + thinking switch) -> the prompt text of a model family (stage 1).

Owns: the encoder registry keyed by config.json's `model_type` (`glm_moe_dsa`: the checkpoint's own Jinja
template, GLM-5's; `deepseek_v32`: DeepSeek-V3.2's published Python encoding, since that checkpoint ships no
Jinja template), the common input clean-up (tool-call arguments given as JSON text become objects, as vLLM
does before rendering), and `EncodedPrompt.thinking`: whether the prompt leaves the model inside an open
`<think>`, which is what the reasoning parser needs to know.

Errors are `ChatTemplateError` (a ValueError): the serving layer turns them into 400s on `messages`.
"""

from __future__ import annotations

from dsaserve.server.chat_encoding.base import ChatEncoder, EncodedPrompt, parsed_tool_calls
from dsaserve.server.chat_encoding.deepseek_v32 import DeepSeekV32Encoder
from dsaserve.server.chat_encoding.glm5 import TemplateEncoder
from dsaserve.server.hf_tokenizer import ChatTemplateError, HFTokenizer


def encoder_for(model_type: str | None, tokenizer: HFTokenizer) -> ChatEncoder:
    """The family's encoder; any other model type renders its checkpoint's Jinja template."""
    if model_type == "deepseek_v32" and not tokenizer.chat_template:
        return DeepSeekV32Encoder()
    return TemplateEncoder(tokenizer)


__all__ = ["ChatEncoder", "ChatTemplateError", "EncodedPrompt", "encoder_for", "parsed_tool_calls"]
